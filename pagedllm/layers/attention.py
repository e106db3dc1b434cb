"""Paged attention (Kwon et al., SOSP 2023): new K/V are written into the block pool through the
slot mapping; attention reads each sequence's K/V through its block table.

``AttentionBackend`` is the small interface a faster kernel (FlashAttention, FlashInfer, a CPU
kernel) replaces; ``TorchPagedAttention`` is the reference, pure PyTorch, for CPU and CUDA.

KV cache of one layer: ``kv_cache`` [2, num_blocks, block_size, num_kv_heads, head_dim];
the slot of token position p of a request is ``block_table[p // block_size] * block_size +
p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

try:  # grouped-query attention inside SDPA (PyTorch >= 2.5)
    F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                   enable_gqa=True)
    _HAS_GQA = True
except TypeError:
    _HAS_GQA = False


@dataclass
class PrefillSeq:
    """One sequence with more than one new token in this step (a prompt or a prompt chunk).

    ``query_start``/``query_end`` index the flat batch; ``seq_len`` counts all its tokens with K/V
    after this step (cached prefix + new); ``context_slots`` [seq_len] (int64) holds the slots of
    all of them, or None when the whole sequence is new (no cached prefix: K/V come from the
    batch itself).
    """

    query_start: int
    query_end: int
    seq_len: int
    context_slots: Optional[torch.Tensor]


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every layer.

    The first ``num_decode_tokens`` tokens are one-token sequences (decode steps);
    ``decode_slots`` [B, L] (int64) are the slots of their whole context (padded), and
    ``decode_mask`` [B, 1, 1, L] (bool) marks the valid ones. ``prefills`` follow in order.
    ``slot_mapping`` [N] (int64) says where each new token's K/V are written.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_slots: Optional[torch.Tensor] = None
    decode_mask: Optional[torch.Tensor] = None
    prefills: list[PrefillSeq] = field(default_factory=list)


class AttentionBackend:
    """Computes attention for the flat batch. q [N, H, D], k/v [N, Hkv, D] -> [N, H, D].

    ``sliding_window`` W: a query at position p sees keys at positions p - W < j <= p
    (transformers' ``sliding_window_overlay``). ``logits_soft_cap`` c: scores become
    c * tanh(scores / c) before the mask and softmax (Gemma 2; transformers' eager attention).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, scale: float, *, sliding_window: Optional[int] = None,
                logits_soft_cap: Optional[float] = None) -> torch.Tensor:
        raise NotImplementedError


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, is_causal: bool = False,
          mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, Tk, D] (grouped-query attention when Hkv < H)."""
    if q.shape[1] != k.shape[1]:
        if _HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
                        soft_cap: Optional[float]) -> torch.Tensor:
    """Attention with scores materialised, for what SDPA cannot do (soft-capping). q [B, H, Tq, D],
    k/v [B, Hkv, Tk, D], mask (bool, True = visible) broadcastable to [B, H, Tq, Tk]."""
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap:
        s = torch.tanh(s / soft_cap) * soft_cap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Optional[torch.Tensor],
            soft_cap: Optional[float]) -> torch.Tensor:
    """Causal attention when ``mask`` is None, else attention under ``mask`` (see
    ``_explicit_attention`` for shapes)."""
    if not soft_cap:
        return _sdpa(q, k, v, scale, is_causal=mask is None, mask=mask)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    return _explicit_attention(q, k, v, scale, mask, soft_cap)


def _window_mask(q_pos: torch.Tensor, num_keys: int, window: Optional[int]) -> torch.Tensor:
    """[Tq, Tk] bool: key j visible to the query at position q_pos[i] iff q_pos[i] - W < j <= q_pos[i]."""
    j = torch.arange(num_keys, device=q_pos.device)
    mask = j.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window:
        mask &= j.unsqueeze(0) > (q_pos - window).unsqueeze(1)
    return mask


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence. q [B, H, D], k/v [B, Hkv, L, D], mask [B, 1, 1, L] -> [B, H, D].

    The G = H / Hkv query heads that share a KV head are laid out as G queries of that head, so
    K/V are never expanded (head h reads KV head h // G, as in transformers' ``repeat_kv``).
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    o = F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, h, d)


class TorchPagedAttention(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None):
        out = torch.empty_like(q)
        if kv_cache is not None:
            flat_k = kv_cache[0].view(-1, *kv_cache.shape[-2:])
            flat_v = kv_cache[1].view(-1, *kv_cache.shape[-2:])
            # Write first: a sequence's new tokens attend to themselves through the cache.
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decode_tokens
        if nd:
            b, length = meta.decode_slots.shape
            idx = meta.decode_slots.view(-1)
            ck = flat_k.index_select(0, idx).view(b, length, *k.shape[1:]).transpose(1, 2)
            cv = flat_v.index_select(0, idx).view(b, length, *v.shape[1:]).transpose(1, 2)
            mask = meta.decode_mask
            if sliding_window:  # the query sits at the last valid slot
                last = mask.view(b, length).sum(-1) - 1
                mask = mask & (torch.arange(length, device=q.device) > (last - sliding_window).unsqueeze(1)).view(
                    b, 1, 1, length)
            if logits_soft_cap:
                hkv = ck.shape[1]
                out[:nd] = _explicit_attention(q[:nd].view(b, hkv, -1, q.shape[-1]), ck, cv, scale, mask,
                                               logits_soft_cap).reshape(b, *q.shape[1:])
            else:
                out[:nd] = _decode_attention(q[:nd], ck, cv, mask, scale)
        for p in meta.prefills:
            qs = q[p.query_start:p.query_end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            if p.context_slots is None:
                ks = k[p.query_start:p.query_end].transpose(0, 1).unsqueeze(0)
                vs = v[p.query_start:p.query_end].transpose(0, 1).unsqueeze(0)
                t = p.query_end - p.query_start
                mask = _window_mask(torch.arange(t, device=q.device), t, sliding_window) if sliding_window else None
                o = _attend(qs, ks, vs, scale, mask, logits_soft_cap)
            else:
                ks = flat_k.index_select(0, p.context_slots).transpose(0, 1).unsqueeze(0)
                vs = flat_v.index_select(0, p.context_slots).transpose(0, 1).unsqueeze(0)
                t = p.query_end - p.query_start
                # Query i sits at position seq_len - t + i and sees keys 0 .. that position.
                mask = _window_mask(torch.arange(p.seq_len - t, p.seq_len, device=q.device), p.seq_len, sliding_window)
                o = _attend(qs, ks, vs, scale, mask, logits_soft_cap)
            out[p.query_start:p.query_end] = o.squeeze(0).transpose(0, 1)
        return out
