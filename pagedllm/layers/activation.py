"""Gated activations: SiLU(gate) * up over a merged [gate | up] projection (vLLM's ``SiluAndMul``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] laid out [gate | up] -> silu(gate) * up [..., I], contiguous, x's dtype.

    Two kernels and one new tensor: SiLU runs in place over x's gate half (x is overwritten there),
    the product goes into a fresh contiguous tensor, which the down projection reads without a copy.
    The same ops in the same order as transformers' ``act_fn(gate_proj(x)) * up_proj(x)``.
    """
    i = x.shape[-1] // 2
    return torch.mul(F.silu(x[..., :i], inplace=True), x[..., i:])
