"""Activations: by their Hugging Face config name (``hidden_act``/``activation_function``), matching
transformers' ``ACT2FN`` for the names our models use; and the gated SiLU(gate) * up over a merged
[gate | up] projection (vLLM's ``SiluAndMul``)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    # tanh approximation (Hendrycks & Gimpel, 2016), used by GPT-2 and Gemma
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation named ``name``.

    Raises:
        ValueError: an activation we do not implement (the message lists those we do).
    """
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] laid out [gate | up] -> silu(gate) * up [..., I], contiguous, x's dtype.

    Two kernels and one new tensor: SiLU runs in place over x's gate half (x is overwritten there),
    the product goes into a fresh contiguous tensor, which the down projection reads without a copy.
    The same ops in the same order as transformers' ``act_fn(gate_proj(x)) * up_proj(x)``.
    """
    if x.device.type == "cpu":  # one C pass (platforms/cpu/fused_ops.py), x left as it is, if it applies
        out = cpu_fused_ops.silu_and_mul(x)
        if out is not None:
            return out
    i = x.shape[-1] // 2
    return torch.mul(F.silu(x[..., :i], inplace=True), x[..., i:])
