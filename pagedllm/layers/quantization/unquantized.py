"""The float method: ``y = F.linear(x, W, b)`` with ``W`` as loaded.

On a CPU, float32 and bfloat16 weights are packed once after loading into oneDNN's blocked layout
and multiplied with ``torch.ops.mkldnn._linear_pointwise`` (what PyTorch's own CPU compiler,
Inductor, does for linear layers): on an AVX-512 AMD EPYC this runs the model's decode-shaped
matmuls 1.2-2.4x faster than ``F.linear`` in float32 (MKL's sgemm) and 1.1-1.3x in bfloat16 (3.2x
at 256 rows, a prefill chunk), with the same results within float32 rounding (bfloat16: equal). A layer's own copy of
the weight is then released (the tied LM head keeps it: the embedding reads it).
Where it applies (AVX-512, and AVX512-BF16 for bfloat16; ``platforms/cpu/float_gemm.py``), our own
panel GEMM takes the place of oneDNN's: it splits decode-sized matmuls evenly over the threads,
where oneDNN left one thread idle part of the time (SmolLM2's attention and MLP-down shapes at 48
rows: 1.4-1.6x faster; benchmarks/README.md section 10).
``PAGEDLLM_CPU_PACKED_LINEAR=0`` turns both off; ``PAGEDLLM_CPU_FLOAT_GEMM=0`` only ours.
Both packings are the platform's (``platforms/ops.py``: ``pack_gemm_weight``, ``pack_library_weight``;
natively neither applies and the layer keeps ``F.linear``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase
from pagedllm.platforms import ops


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = getattr(layer, "weight", None)
        if w is None:
            return
        packed = ops.pack_gemm_weight(w)
        if packed is not None:
            layer.register_buffer("gemm_weight", packed, persistent=False)
            layer.out_features = w.shape[0]
            if not _is_tied(layer):
                w.data = torch.empty(0, dtype=w.dtype)
            layer.packed_bytes = packed.numel() * packed.element_size()
            return
        packed = ops.pack_library_weight(w)
        if packed is None:
            return
        layer.register_buffer("packed_weight", packed, persistent=False)
        layer.out_features = w.shape[0]
        if not _is_tied(layer):
            layer.packed_bytes = w.numel() * w.element_size()
            w.data = torch.empty(0, dtype=w.dtype)  # the packed copy replaces it

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        gemm_weight = getattr(layer, "gemm_weight", None)
        if gemm_weight is not None:
            y = ops.gemm_linear(x.reshape(-1, x.shape[-1]), gemm_weight, bias, layer.out_features)
            if y is not None:
                return y.view(*x.shape[:-1], layer.out_features)
        packed = getattr(layer, "packed_weight", None)
        if packed is not None:
            y = ops.library_linear(x.reshape(-1, x.shape[-1]), packed, bias)
            if y is not None:
                return y.view(*x.shape[:-1], layer.out_features)
        return F.linear(x, layer.weight, bias)


def _is_tied(layer: nn.Module) -> bool:
    """The LM head, whose weight may be the embedding's (then it must keep the plain tensor):
    ``ParallelLMHead.is_lm_head`` (an attribute, not the class: vocab_embedding imports this package)."""
    return getattr(layer, "is_lm_head", False)
