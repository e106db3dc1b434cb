"""LongRoPE (Ding et al., 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens"),
as Phi-3 uses it: per-frequency rescaling factors, ``short_factor`` for contexts within
``original_max_position_embeddings`` and ``long_factor`` beyond, and cos/sin multiplied by an
attention factor sqrt(1 + ln(factor) / ln(original_max)) (transformers'
``_compute_longrope_parameters``). Also applies partial rotary embeddings (only the first
``rotary_dim`` channels of each head rotate), which plain RoPE configs of Phi-3 variants use.

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

from pagedllm.layers.rotary_embedding import RotaryEmbedding


LONGROPE_TYPES = ("longrope", "su")  # "su" is the name older Phi-3 configs use


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (transformers' ``rotate_half``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _inv_freq(rotary_dim: int, base: float, factors: Optional[list[float]]) -> torch.Tensor:
    """[rotary_dim / 2] float32: RoPE's frequencies, divided by LongRoPE's ``factors`` if given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    return inv_freq if factors is None else inv_freq / torch.tensor(factors, dtype=torch.float32)


class PartialRotaryEmbedding(nn.Module):
    """RoPE on the first ``rotary_dim`` channels of q [N, H, D] and k [N, Hkv, D] at ``positions``
    [N] (int64), rotate-half layout; the rest pass through. ``factors`` [rotary_dim / 2] divide
    the frequencies (LongRoPE), ``attention_factor`` scales cos and sin."""

    def __init__(self, rotary_dim: int, max_position: int, base: float, dtype: torch.dtype,
                 factors: Optional[list[float]] = None, attention_factor: float = 1.0) -> None:
        super().__init__()
        inv_freq = _inv_freq(rotary_dim, base, factors)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = rotary_dim
        self.register_buffer("cos_cache", (emb.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * attention_factor).to(dtype), persistent=False)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        rot = rot * cos + _rotate_half(rot) * sin
        return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)


def get_phi3_rope(head_dim: int, max_position: int, rope: dict, dtype: torch.dtype,
                  max_model_len: int) -> nn.Module:
    """The rotary embedding for ``rope`` (``get_rope_parameters`` output; default or LongRoPE)
    for positions below ``max_model_len``; ``max_position`` is the config's
    ``max_position_embeddings`` (it sets LongRoPE's default factor). Where every channel rotates
    (Phi-3 mini/small/medium) it is the shared ``RotaryEmbedding`` with these frequencies: its table
    is gathered once a step and applied in place by the fused kernel (and the CPU layer runner
    takes it); the same products and sums as ``PartialRotaryEmbedding``, so the same values.

    Raises:
        ValueError: a rope type other than default/longrope/su.
    """
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    base = float(rope.get("rope_theta", 10000.0))
    size = max_model_len
    rope_type = rope.get("rope_type", "default")

    def make(factors: Optional[list[float]] = None, attention_factor: float = 1.0) -> nn.Module:
        if rotary_dim == head_dim:
            return RotaryEmbedding(head_dim, size, {}, dtype, inv_freq=_inv_freq(head_dim, base, factors),
                                   attention_factor=attention_factor)
        return PartialRotaryEmbedding(rotary_dim, size, base, dtype, factors, attention_factor)

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
