"""The CUDA wing's bodies for the ops of ``platforms/ops.py``. CUDA tensors take our Triton kernels
(``triton_ops.py``: the norms, the activations, RoPE) where triton imports and the kernel applies, else
the seam's native torch bodies (None); ``int8_mm`` has cuBLASLt's detours.

``CudaOps`` extends the CPU wing's ``CpuOps``: a GPU host still holds CPU tensors (``--device cpu``,
the layers' unit tests), and those keep the CPU kernels exactly as on a CPU-only host; every CPU
body returns None for a CUDA tensor. The one exception is Triton's interpreter: where
``triton_ops`` was imported under ``TRITON_INTERPRET=1`` its kernels run on CPU tensors, and then
CPU tensors take them too (tests/test_triton_ops.py, on a host without a GPU). The CPU platform
never uses ``CudaOps``.
"""
from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu.ops import CpuOps

logger = logging.getLogger("pagedllm")
_UNRESOLVED = object()
_KERNELS: "ModuleType | None | object" = _UNRESOLVED  # triton_ops once imported; None: triton does not import
_CPU_KERNELS: Optional[ModuleType] = None  # triton_ops where it runs interpreted (CPU tensors), else None


def _kernels() -> Optional[ModuleType]:
    """``triton_ops``, imported on the first CUDA tensor's op (not at import: CPU-only installs lack
    triton), or None where triton does not import (logged once; the native bodies run)."""
    global _KERNELS, _CPU_KERNELS
    if _KERNELS is _UNRESOLVED:
        try:
            # lazily: triton is an optional dependency (the [cuda]/[test] extras), and ~1 s to import
            from pagedllm.platforms.cuda import triton_ops
        except ImportError as e:
            logger.info("cuda elementwise ops: PyTorch ops (triton does not import: %s)", e)
            _KERNELS = None
        else:
            _KERNELS = triton_ops
            _CPU_KERNELS = triton_ops if triton_ops.INTERPRET else None
    return _KERNELS  # type: ignore[return-value]


def _triton_for(x: torch.Tensor) -> Optional[ModuleType]:
    """The Triton kernels for x's device: CUDA tensors where triton imports; CPU tensors only under
    Triton's interpreter (``_CPU_KERNELS``); else None (CPU tensors: the CPU kernels)."""
    return _kernels() if x.is_cuda else _CPU_KERNELS


@functools.lru_cache(maxsize=None)
def _capability(index: Optional[int]) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _triton_else_cpu(name: str) -> staticmethod:
    """The body of op ``name`` for ``CudaOps``: the Triton kernel for the device of its first tensor
    argument (each kernel tests its own preconditions), else ``CpuOps``' C kernel (CPU tensors; None
    for CUDA ones, and the seam runs its native body). Signatures: ``PlatformOps.<name>``."""

    def body(x: torch.Tensor, *args):
        tk = _triton_for(x)
        return getattr(CpuOps if tk is None else tk, name)(x, *args)
    body.__name__ = body.__qualname__ = name
    return staticmethod(body)


class CudaOps(CpuOps):
    # -- norms, activations, RoPE: the Triton kernels, else CpuOps' (gemma_add_rms_norm_'s first
    # tensor is the residual, on x's device)
    rms_norm = _triton_else_cpu("rms_norm")
    rms_norm_heads_ = _triton_else_cpu("rms_norm_heads_")
    gemma_rms_norm = _triton_else_cpu("gemma_rms_norm")
    gemma_add_rms_norm_ = _triton_else_cpu("gemma_add_rms_norm_")
    silu_and_mul = _triton_else_cpu("silu_and_mul")
    gelu_tanh_and_mul = _triton_else_cpu("gelu_tanh_and_mul")
    rotary_ = _triton_else_cpu("rotary_")

    @staticmethod
    def int8_mm(a: torch.Tensor, b: torch.Tensor, b_row_sums: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
        """``torch._int_mm`` on CUDA needs m > 16 and k, n multiples of 8, and cuBLASLt refuses a
        row-major ``b`` for some shapes (seen on an H200, torch 2.11: [k, n] contiguous failed at
        m=1, n=48 and n=49152; the transposed view of an [n, k] weight, which the int8 method
        stores, ran every shape exactly). So m <= 16 rows are padded with zeros, and other k, n
        fall back to a float32 matmul of the int8 values (exact while k * 127^2 < 2^24, i.e.
        k <= 1040; a relative error ~1e-7 beyond). Other shapes: None (the native ``_int_mm``)."""
        if not a.is_cuda:
            return CpuOps.int8_mm(a, b, b_row_sums)
        m, k = a.shape
        n = b.shape[1]
        if k % 8 or n % 8:
            return torch.mm(a.float(), b.float()).round_().to(torch.int32)
        if m <= 16:
            return torch._int_mm(torch.cat([a, a.new_zeros(17 - m, k)]), b)[:m]
        return None

    @staticmethod
    def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """bf16 on CUDA, SM 8.0+ with ``F.grouped_mm`` (SM 9.x with the older ``torch._grouped_mm``),
        16-byte aligned rows."""
        if not x.is_cuda or not (x.dtype == w13.dtype == w2.dtype == torch.bfloat16):
            return False
        if w2.shape[1] % 8 or w2.shape[2] % 8:
            return False
        cap = _capability(x.device.index)
        return cap >= (8, 0) if hasattr(F, "grouped_mm") else cap[0] == 9
