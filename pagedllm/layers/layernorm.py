"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Llama's reference implementation does,
optionally fused with the residual add that precedes it (vLLM's ``fused_add_rms_norm``)."""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

# torch>=2.4: one call into ATen instead of six from Python; in float32 it computes exactly
# x * rsqrt(mean(x^2) + eps) * weight, bit for bit the transformers formula (tests/test_layers.py).
_rms_norm = getattr(F, "rms_norm", None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) for x [..., hidden]: the statistics in float32, the
    normalized x rounded back to x's dtype before the weight multiply (transformers' LlamaRMSNorm)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and _rms_norm is not None:
        return _rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    if _rms_norm is not None:
        return weight * _rms_norm(x.float(), weight.shape, None, eps).to(dtype)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RMSNorm(nn.Module):
    """forward(x) -> norm(x): x [..., hidden] -> same shape and dtype.

    forward(x, residual) -> (norm(x + residual), x + residual): the pre-norm block's residual add
    fused into the norm call, with vLLM's ``fused_add_rms_norm`` semantics. ``residual`` is updated
    in place (it must be a tensor the caller owns) and returned as the new residual stream.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if x.device.type == "cpu":  # one C pass over the rows (platforms/cpu/fused_ops.py), if it applies
            out = cpu_fused_ops.add_rms_norm(x, self.weight, self.eps, residual)
            if out is not None:
                return out if residual is None else (out, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        residual.add_(x)  # same rounding as transformers' ``residual + hidden_states``
        return rms_norm(residual, self.weight, self.eps), residual

    def forward_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] (a view of the qkv projection: strides free, D contiguous) -> the norm
        over D of each head (Qwen3's q/k norms): in place on x through the CPU kernel where it
        applies (one pass, no copy), else ``forward(x)``, a new tensor."""
        if (x.is_cpu and type(self).forward is RMSNorm.forward
                and cpu_fused_ops.rms_norm_heads_(x, self.weight, self.eps)):
            return x
        return self(x)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al., 2016) over the last dim: (x - mean) / sqrt(var + eps) * weight + bias,
    as ``torch.nn.LayerNorm``; ``affine=False`` has neither weight nor bias (OPT's
    ``layer_norm_elementwise_affine``), ``bias=False`` a weight only (Cohere's). x [..., hidden] ->
    same shape and dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype=torch.float32, affine: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False) if affine else None
        self.bias = (nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
                     if affine and bias else None)
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """With ``residual``, RMSNorm's fused-add API: (norm(residual + x), residual + x), the
        residual updated in place (transformers' ``residual + hidden_states``, rounded alike)."""
        if residual is None:
            return torch.nn.functional.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        residual.add_(x)
        return torch.nn.functional.layer_norm(residual, (self.hidden_size,), self.weight, self.bias, self.eps), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast to x's
    dtype (transformers' ``Gemma2RMSNorm``; the checkpoint stores weight around 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dim() == 2:  # one C pass (platforms/cpu/fused_ops.py), if it applies
            out = cpu_fused_ops.gemma_rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)

    def forward_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] (a view of the qkv projection) -> the norm over D of each head (Gemma 3's
        q/k norms): in place through the CPU kernel where it applies, else ``forward(x)``."""
        if (x.is_cpu and type(self).forward is GemmaRMSNorm.forward
                and cpu_fused_ops.rms_norm_heads_(x, self.weight, self.eps, gemma=True)):
            return x
        return self(x)

    def add_to_(self, residual: torch.Tensor, x: torch.Tensor,
                next_norm: Optional["GemmaRMSNorm"] = None) -> torch.Tensor:
        """Gemma's post-norm: residual [N, hidden] <- residual + self(x) in place (transformers'
        ``residual + post_norm(branch)``, rounded alike). Returns ``next_norm(residual)`` (a new
        tensor) when given, else the residual; on a CPU both in one C pass where the kernel applies."""
        if residual.is_cpu and (next_norm is None or type(next_norm) is GemmaRMSNorm) and type(self) is GemmaRMSNorm:
            out = cpu_fused_ops.gemma_add_rms_norm_(residual, x, self.weight, self.eps,
                                                    None if next_norm is None else next_norm.weight,
                                                    0.0 if next_norm is None else next_norm.eps)
            if out is not None:
                return out
        residual.add_(self(x))
        return residual if next_norm is None else next_norm(residual)
