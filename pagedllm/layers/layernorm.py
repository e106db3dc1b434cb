"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Llama's reference implementation does."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x [..., hidden] -> weight * x / sqrt(mean(x^2) + eps), same dtype as x."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al., 2016) over the last dim: (x - mean) / sqrt(var + eps) * weight + bias,
    as ``torch.nn.LayerNorm``; ``affine=False`` has neither weight nor bias (OPT's
    ``layer_norm_elementwise_affine``). x [..., hidden] -> same shape and dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype=torch.float32, affine: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False) if affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False) if affine else None
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast to x's
    dtype (transformers' ``Gemma2RMSNorm``; the checkpoint stores weight around 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)
