"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Llama's reference implementation does,
optionally fused with the residual add that precedes it (vLLM's ``fused_add_rms_norm``). The
arithmetic is the op seam's (``platforms/ops.py``: the platform's kernel, else torch)."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from pagedllm.platforms import ops


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
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] (a view of the qkv projection: strides free, D contiguous) -> the norm
        over D of each head (Qwen3's q/k norms): in place on x through the platform's kernel where
        it applies (one pass, no copy), else a new tensor (``ops.rms_norm_heads``); a subclass
        that overrides ``forward`` gets ``forward(x)``."""
        if type(self).forward is RMSNorm.forward:
            return ops.rms_norm_heads(x, self.weight, self.eps)
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
        return ops.gemma_rms_norm(x, self.weight, self.eps)

    def forward_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] (a view of the qkv projection) -> the norm over D of each head (Gemma 3's
        q/k norms): in place through the platform's kernel where it applies, else a new tensor."""
        if type(self).forward is GemmaRMSNorm.forward:
            return ops.gemma_rms_norm_heads(x, self.weight, self.eps)
        return self(x)

    def add_to_(self, residual: torch.Tensor, x: torch.Tensor,
                next_norm: Optional["GemmaRMSNorm"] = None) -> torch.Tensor:
        """Gemma's post-norm: residual [N, hidden] <- residual + self(x) in place (transformers'
        ``residual + post_norm(branch)``, rounded alike). Returns ``next_norm(residual)`` (a new
        tensor) when given, else the residual; both in one pass where the platform's kernel applies
        (``ops.gemma_add_rms_norm_``). Subclasses (another ``forward``) take the two calls."""
        if (next_norm is None or type(next_norm) is GemmaRMSNorm) and type(self) is GemmaRMSNorm:
            return ops.gemma_add_rms_norm_(residual, x, self.weight, self.eps,
                                           None if next_norm is None else next_norm.weight,
                                           0.0 if next_norm is None else next_norm.eps)
        residual.add_(self(x))
        return residual if next_norm is None else next_norm(residual)
