"""The CPU wing's bodies for the ops of ``platforms/ops.py``: the C kernels of ``fused_ops.py``,
``float_gemm.py`` and ``int8_gemm.py``, and oneDNN's packed linear (``torch.ops.mkldnn``).

Each body keeps its kernel's own preconditions (a CPU tensor, float32 or bfloat16, the layout the
kernel reads, the library built, its switch on) and returns None (in-place ones: False) where one
fails; the seam then runs its native torch body, exactly as the layers did before the seam. The
device test is ``is_cpu``, which is 4x cheaper than ``device.type`` (this runs per layer and op).

Kernel functions the tests patch (``float_gemm.linear``, ``int8_gemm.int8_gemm``,
``int8_gemm.panel_linear``...) are looked up on their module at call time, not bound here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.platforms.cpu import float_gemm, fused_ops, gguf_gemm, int8_gemm
from pagedllm.platforms.interface import PlatformOps


def can_pack(w: torch.Tensor) -> bool:
    """Whether a float linear weight may be packed at all (our GEMM's panels or oneDNN's blocked
    layout): a 2-d float32/bfloat16 CPU tensor, ``PAGEDLLM_CPU_PACKED_LINEAR`` not 0 (read per
    call: load time), and a PyTorch built with oneDNN's linear."""
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2 and w.numel() > 0
            and envs.PAGEDLLM_CPU_PACKED_LINEAR
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class CpuOps(PlatformOps):
    # -- norms, activations, RoPE, sampling: fused_ops.py's kernels test their own preconditions
    rms_norm = staticmethod(fused_ops.add_rms_norm)
    rms_norm_heads_ = staticmethod(fused_ops.rms_norm_heads_)
    gemma_rms_norm = staticmethod(fused_ops.gemma_rms_norm)
    gemma_add_rms_norm_ = staticmethod(fused_ops.gemma_add_rms_norm_)
    silu_and_mul = staticmethod(fused_ops.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(fused_ops.gelu_tanh_and_mul)
    rotary_ = staticmethod(fused_ops.rotary_)
    argmax_rows = staticmethod(fused_ops.argmax_rows_or_none)
    quantize_per_token = staticmethod(fused_ops.quantize_rows)
    int8_epilogue = staticmethod(fused_ops.int8_epilogue)

    # -- float linear layers
    @staticmethod
    def pack_gemm_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
        if not can_pack(w) or not float_gemm.supported(w):
            return None
        return float_gemm.pack(w.detach())

    @staticmethod
    def gemm_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                    n: int) -> Optional[torch.Tensor]:
        if x.dtype != packed.dtype or not x.is_cpu:
            return None
        return float_gemm.linear(x, packed, bias, n)

    @staticmethod
    def pack_library_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
        """oneDNN's blocked layout, kept only where a probe matmul agrees with ``F.linear``."""
        if not can_pack(w):
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
            probe = torch.ones(2, w.shape[1], dtype=w.dtype)
            ok = torch.allclose(torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float(),
                                F.linear(probe, w).float(), rtol=1e-2, atol=1e-2)
        except RuntimeError:
            return None
        return packed if ok else None

    @staticmethod
    def library_linear(x: torch.Tensor, packed: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x.dtype != packed.dtype or not x.is_cpu:
            return None
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    # -- W8A8 int8 linear layers
    @staticmethod
    def int8_mm(a: torch.Tensor, b: torch.Tensor, b_row_sums: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
        # the small-batch VNNI kernel reads the [n, k] weight whose transposed view b is
        return None if b_row_sums is None else int8_gemm.int8_gemm(a, b.t(), b_row_sums)

    @staticmethod
    def int8_pack_panels(w: torch.Tensor) -> Optional[torch.Tensor]:
        return int8_gemm.panel_pack(w) if int8_gemm.panel_supported(w) else None

    @staticmethod
    def int8_unpack_panels(packed: torch.Tensor, n: int, k: int) -> Optional[torch.Tensor]:
        return int8_gemm.panel_unpack(packed, n, k)

    @staticmethod
    def int8_panel_gemm(a: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        return int8_gemm.panel_gemm(a, packed, wsum, n)

    @staticmethod
    def int8_panel_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                          bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return int8_gemm.panel_linear(x, packed, wsum, scale, bias)

    @staticmethod
    def int8_panels_only() -> bool:
        return int8_gemm.int_mm_is_slow()

    # -- GGUF weights kept in their ggml blocks
    @staticmethod
    def gguf_kernel_types() -> tuple[frozenset, str]:
        ok, how = gguf_gemm.available()
        if not ok:
            return frozenset(), how
        return frozenset(gguf_gemm.TYPE_IDS), (f"int8 dot products per block of 32, 256 for the K-quants "
                                               f"(from 4-8 rows on unpacked panels) ({how})")

    @staticmethod
    def gguf_linear(x: torch.Tensor, segments: list, n: int) -> Optional[torch.Tensor]:
        if not x.is_cpu or x.dim() != 2 or x.shape[1] % 32 or gguf_gemm._LIBRARY.get()[0] is None:
            return None
        return gguf_gemm.linear(x, segments, n)
