"""Rotary position embedding (RoPE; Su et al., 2021, "RoFormer") in the rotate-half (GPT-NeoX)
layout used by Llama/Qwen checkpoints, with the ``linear``, ``llama3`` and ``yarn`` (Peng et al.,
2023, "YaRN: Efficient Context Window Extension of Large Language Models") frequency scalings.
Frequencies follow transformers' ``modeling_rope_utils`` so fp32 results match it."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pagedllm.platforms import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def compute_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for ``rope`` (``rope_theta``, ``rope_type``...).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    base = float(rope.get("rope_theta", 10000.0))
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope, base, pos_freqs)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _yarn_inv_freq(dim: int, rope: dict, base: float, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies from ``pos_freqs`` = base ** (2i / dim): interpolated (divided by
    ``factor``) below the correction range of dimensions, extrapolated (unchanged) above it, a
    linear ramp between; the range is where a dimension turns beta_fast to beta_slow times over
    ``original_max_position_embeddings`` (transformers' ``_compute_yarn_parameters``, the same
    float32 operations)."""
    factor, old_len = float(rope["factor"]), rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope: dict) -> float:
    """What cos and sin are multiplied by: YaRN's ``attention_factor``, by default 0.1 ln(factor) + 1
    (or the ratio of that with ``mscale`` and ``mscale_all_dim``, DeepSeek's); 1 for the others."""
    if rope.get("rope_type") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = float(rope["factor"]), rope.get("mscale"), rope.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class RotaryEmbedding(nn.Module):
    """RoPE for q [N, H, D] and k [N, Hkv, D] at ``positions`` [N] (int64).

    ``forward(positions, q, k)`` returns rotated copies (the original API). The fast path splits the
    work per step: ``cos_sin(positions)`` gathers cos and sign-folded sin ONCE per step (one index
    into one table), and ``forward(positions, q, k, cos_sin=...)`` / ``apply_(x, cos_sin)`` rotate in
    place with four elementwise ops per tensor, so a model shares one gather across its layers.

    In rotate-half form, rot(x) = x * cos + [-x2, x1] * sin. The fast path computes
    [-x2, x1] * sin as roll(x, D/2) * [-sin, sin]: the same products and the same single add, so
    float32 results equal transformers' bit for bit.

    Partial rotary (``rotary_dim`` R < D, Phi-4-mini's ``partial_rotary_factor``): the first R
    channels of each head rotate (rotate-half over R), the rest pass through, as transformers'
    ``apply_rotary_pos_emb`` does on ``q[..., :R]``; the table and ``cos_sin`` are R wide.
    """

    def __init__(self, head_dim: int, max_position: int, rope: dict, dtype: torch.dtype, *,
                 inv_freq: Optional[torch.Tensor] = None, attention_factor: float = 1.0,
                 rotary_dim: Optional[int] = None) -> None:
        """``inv_freq`` [rotary_dim / 2] float32: frequencies computed elsewhere (LongRoPE's; None:
        from ``rope``); ``attention_factor`` scales cos and sin (LongRoPE's, as transformers does
        in float32 before the cast to ``dtype``); ``rotary_dim`` (even, at most head_dim; None:
        head_dim) the channels that rotate."""
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if inv_freq is None:
            inv_freq = compute_inv_freq(rotary_dim, rope)
            attention_factor *= rope_attention_factor(rope)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        # [max_position, 2, R]: cos and [-sin(f), sin(f)] side by side, gathered with one index.
        cos, sin = emb.cos(), freqs.sin()
        if attention_factor != 1.0:  # (-s) * a == -(s * a): the sign fold stays exact
            cos, sin = cos * attention_factor, sin * attention_factor
        signed_sin = torch.cat((-sin, sin), dim=-1)
        self.register_buffer("cos_sin_cache", torch.stack((cos, signed_sin), dim=1).to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """[N, 2, 1, R]: cos and sign-folded sin at ``positions`` [N]; compute once per step."""
        return self.cos_sin_cache.index_select(0, positions).unsqueeze(2)

    def apply_(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [N, h, D] (any strides, last dim contiguous) in place; returns x."""
        ops.rotary_(x if self.rotary_dim == self.head_dim else x[..., :self.rotary_dim], cos_sin)
        return x

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). With ``cos_sin`` (from ``cos_sin(positions)``) q and k are rotated in
        place and returned; without it new tensors are returned and q, k are left unchanged."""
        if cos_sin is not None:
            return self.apply_(q, cos_sin), self.apply_(k, cos_sin)
        cos_sin = self.cos_sin(positions)
        return self.apply_(q.clone(), cos_sin), self.apply_(k.clone(), cos_sin)
