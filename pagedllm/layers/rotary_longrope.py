"""LongRoPE (Ding et al., 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens"),
as Phi-3 uses it: per-frequency rescaling factors, ``short_factor`` for contexts within
``original_max_position_embeddings`` and ``long_factor`` beyond, and cos/sin multiplied by an
attention factor sqrt(1 + ln(factor) / ln(original_max)) (transformers'
``_compute_longrope_parameters``). Partial rotary embeddings (only the first ``rotary_dim``
channels of each head rotate, Phi-4-mini) are ``RotaryEmbedding``'s ``rotary_dim``.

Which factors: transformers switches to ``long_factor`` once a sequence grows past the original
length and recomputes that sequence's whole KV cache with them. A paged cache keeps K already
written, so, as vLLM does, the choice is made once per engine: ``long_factor`` when
``max_model_len`` exceeds ``original_max_position_embeddings``, else ``short_factor``. Outputs
equal transformers' for sequences on the same side of the original length as ``max_model_len``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pagedllm.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq


LONGROPE_TYPES = ("longrope", "su")  # "su" is the name older Phi-3 configs use


def _inv_freq(rotary_dim: int, base: float, factors: Optional[list[float]]) -> torch.Tensor:
    """[rotary_dim / 2] float32: RoPE's frequencies, divided by LongRoPE's ``factors`` if given."""
    inv_freq = compute_inv_freq(rotary_dim, {"rope_theta": base})
    return inv_freq if factors is None else inv_freq / torch.tensor(factors, dtype=torch.float32)


def get_phi3_rope(head_dim: int, max_position: int, rope: dict, dtype: torch.dtype,
                  max_model_len: int) -> nn.Module:
    """The rotary embedding for ``rope`` (``get_rope_parameters`` output; default or LongRoPE)
    for positions below ``max_model_len``; ``max_position`` is the config's
    ``max_position_embeddings`` (it sets LongRoPE's default factor). It is the shared
    ``RotaryEmbedding`` with these frequencies, on the first ``partial_rotary_factor`` of each head's
    channels (all of them for Phi-3 mini/small/medium, 3/4 for Phi-4-mini): its table is gathered
    once a step and applied in place by the fused kernel (and the CPU layer runner takes it).

    Raises:
        ValueError: a rope type other than default/longrope/su.
    """
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    base = float(rope.get("rope_theta", 10000.0))
    size = max_model_len
    rope_type = rope.get("rope_type", "default")

    def make(factors: Optional[list[float]] = None, attention_factor: float = 1.0) -> nn.Module:
        return RotaryEmbedding(head_dim, size, {}, dtype, inv_freq=_inv_freq(rotary_dim, base, factors),
                               attention_factor=attention_factor, rotary_dim=rotary_dim)

    if rope_type == "default":
        return make()
    if rope_type not in LONGROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported for Phi-3 (supported: default, longrope)")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_position / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = rope["long_factor"] if max_model_len > original else rope["short_factor"]
    return make(factors, float(attention_factor))
