"""Activation functions by their Hugging Face config name (``hidden_act``/``activation_function``),
matching transformers' ``ACT2FN`` for the names our models use."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

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
