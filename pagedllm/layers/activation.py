"""Activations: by their Hugging Face config name (``hidden_act``/``activation_function``), matching
transformers' ``ACT2FN`` for the names our models use; and the gated SiLU(gate) * up over a merged
[gate | up] projection (vLLM's ``SiluAndMul``)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pagedllm.platforms import ops

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    # tanh approximation (Hendrycks & Gimpel, 2016), used by GPT-2 and Gemma
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    # x * sigmoid(1.702 x) (CLIP's and Qwen2-VL's vision towers; transformers' QuickGELUActivation)
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
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
    """x [..., 2 * I] laid out [gate | up] -> silu(gate) * up [..., I], contiguous, x's dtype
    (``ops.silu_and_mul``: the platform's kernel leaves x as it is; the torch body overwrites x's
    gate half with SiLU in place, one new tensor for the product, the same ops in the same order
    as transformers' ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return ops.silu_and_mul(x)
