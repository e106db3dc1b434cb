"""The int8 KV cache (``--kv-cache-dtype int8``): a quarter of float32's bytes, half of bfloat16's.

Each (token, KV head) row of K or V is stored as ``head_dim`` int8 values followed by their float32
scale in the row's last 4 bytes, so a layer's cache is one int8 tensor
[2, num_blocks, block_size, num_kv_heads, head_dim + 4] that block copies and views treat like a
float cache. Symmetric per row (as OpenVINO GenAI's default by-token u8 cache, without the zero
point): ``scale = max|x| / 127``, ``value = round_half_even(x * (127 / max|x|))``, read back as
``value * scale``; the error of an element is at most ``scale / 2`` (0.4 % of the row's largest).
The compiled CPU kernel (``paged_attention_cpu.cpp``) writes the same bytes and reads the rows in
place; this module is the torch reference (any device).
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale after each row's values
CHOICES = ("auto", "int8")


def cache_row_size(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements per (token, KV head) row of a cache of ``kv_cache_dtype`` ("auto": the model's)."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def is_int8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (values [..., D] int8, scales [...] float32)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # A true division (``127.0 / amax`` would be ``reciprocal(amax) * 127`` in PyTorch, one more
    # rounding): the C writer computes the same float32 quotient.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    values = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    return values, (amax / 127.0).squeeze(-1)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., D + 4] int8 -> views (values [..., D] int8, scales [...] float32)."""
    d = rows.shape[-1] - SCALE_BYTES
    return rows[..., :d], rows[..., d:].view(torch.float32).squeeze(-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., D + 4] int8 -> [..., D] float32."""
    values, scales = split_rows(rows)
    return values.float() * scales.unsqueeze(-1)


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as an int8 cache holds it: dequantize(quantize(x)), in x's dtype."""
    values, scales = quantize(x)
    return (values.float() * scales.unsqueeze(-1)).to(x.dtype)


def write(x: torch.Tensor, flat_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize x [N, Hkv, D] into slots ``slot_mapping`` [N] of ``flat_cache`` [num_slots, Hkv, D + 4]."""
    values, scales = quantize(x)
    dst_values, dst_scales = split_rows(flat_cache)
    dst_values.index_copy_(0, slot_mapping, values)
    dst_scales.index_copy_(0, slot_mapping, scales)
