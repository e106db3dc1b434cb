"""The int8 KV cache (``--kv-cache-dtype int8``): a quarter of float32's bytes, half of bfloat16's.

Each (token, KV head) row of K or V is stored as ``head_dim`` int8 values with one float32 scale,
symmetric per row (as OpenVINO GenAI's default by-token u8 cache, without the zero point):
``scale = max|x| / 127``, ``value = round_half_even(x * (127 / max|x|))``, read back as
``value * scale``; the error of an element is at most ``scale / 2`` (0.4 % of the row's largest).

Layout: a layer's cache is one int8 tensor [2, num_blocks, block_size + S, num_kv_heads, head_dim]
(so block copies and the block pool treat it like a float cache). In each block, token rows
0 .. block_size - 1 hold the values, and the S = ceil(4 * block_size / head_dim) rows after them
hold the block's scales as float32 [block_size, num_kv_heads]. Values and scales apart keep every
row of values in whole cache lines (64 values: one line, where a bf16 row takes two; a scale at
each row's end measured 5-10 % slower in the attention kernel). The compiled CPU kernel
(``platforms/cpu/paged_attention.cpp``) writes the same bytes and reads them in place; this module is the
torch reference (any device).
"""
from __future__ import annotations

import functools

import torch

CHOICES = ("auto", "int8")


def scale_rows(block_size: int, head_dim: int) -> int:
    """S: token rows after a block's values that hold its float32 scales."""
    return -(-4 * block_size // head_dim)


@functools.lru_cache(maxsize=64)
def block_size_of(rows: int, head_dim: int) -> int:
    """The block_size b with b + scale_rows(b, head_dim) == rows (one exists for a cache made here)."""
    for b in range(rows, 0, -1):
        if b + scale_rows(b, head_dim) == rows:
            return b
    raise ValueError(f"an int8 KV cache block of {rows} rows fits no block size at head_dim {head_dim}")


def block_rows(block_size: int, head_dim: int, kv_cache_dtype: str) -> int:
    """Token rows of one block of a cache of ``kv_cache_dtype`` ("auto": the model's dtype)."""
    return block_size + scale_rows(block_size, head_dim) if kv_cache_dtype == "int8" else block_size


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


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as an int8 cache holds it: dequantize(quantize(x)), in x's dtype."""
    values, scales = quantize(x)
    return (values.float() * scales.unsqueeze(-1)).to(x.dtype)


def split_blocks(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K (or V) half of an int8 cache [num_blocks, block_size + S, Hkv, D] -> views
    (values [num_blocks, block_size, Hkv, D] int8, scales [num_blocks, block_size, Hkv] float32)."""
    nb, rows, hkv, d = cache.shape
    bs = block_size_of(rows, d)
    tail = cache[:, bs:].view(nb, -1)[:, :bs * hkv * 4]  # the scale rows' bytes
    return cache[:, :bs], tail.view(torch.float32).view(nb, bs, hkv)


def write(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize x [N, Hkv, D] into slots ``slot_mapping`` [N] of ``cache`` [num_blocks, block_size + S, Hkv, D]."""
    values, scales = quantize(x)
    dst_values, dst_scales = split_blocks(cache)
    bs = dst_values.shape[1]
    idx = (slot_mapping // bs, slot_mapping % bs)
    dst_values.index_put_(idx, values)
    dst_scales.index_put_(idx, scales)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Slots ``slots`` [N] of ``cache`` [num_blocks, block_size + S, Hkv, D], dequantized: [N, Hkv, D] float32."""
    values, scales = split_blocks(cache)
    bs = values.shape[1]
    blk, off = slots // bs, slots % bs
    return values[blk, off].float() * scales[blk, off].unsqueeze(-1)
