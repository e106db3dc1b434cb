"""The CUDA wing's bodies for the ops of ``platforms/ops.py``. CUDA tensors take the seam's native
torch bodies for now (Triton kernels land here), except where cuBLASLt needs a detour (``int8_mm``).

``CudaOps`` extends the CPU wing's ``CpuOps``: a GPU host still holds CPU tensors (``--device cpu``,
the layers' unit tests), and those keep the CPU kernels exactly as on a CPU-only host; every CPU
body returns None for a CUDA tensor, so CUDA tensors reach the native bodies.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu.ops import CpuOps


@functools.lru_cache(maxsize=None)
def _capability(index: Optional[int]) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


class CudaOps(CpuOps):
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
