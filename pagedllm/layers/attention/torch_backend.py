"""Reference paged attention in pure PyTorch (CPU and CUDA): gathers each sequence's context out of
the paged cache through its block table, then runs SDPA (or an explicit softmax when the logits
are soft-capped). Every faster backend is tested equal to this one.

An int8 cache (``kv_quant.py``) is dequantized as it is gathered (in float32, then rounded to q's
dtype); a prompt attends to its own K/V as the cache holds them (quantized and dequantized), so its
result does not depend on how it was chunked."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import kv_quant
from pagedllm.layers.attention.backend import AttentionBackend, write_kv
from pagedllm.layers.attention.metadata import AttentionMetadata, PrefillSeq

try:  # grouped-query attention inside SDPA (PyTorch >= 2.5)
    F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                   enable_gqa=True)
    _HAS_GQA = True
except TypeError:
    _HAS_GQA = False


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H, T, D], k/v [1, Hkv, T, D], plain causal attention over the same T tokens."""
    if q.shape[1] != k.shape[1]:
        if _HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       soft_cap: Optional[float], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, Hkv, M, D] (the M rows of KV head j are its G query heads x tokens), k/v [B, Hkv, L, D],
    mask [B or 1, 1, M, L] (True = attend), sinks [1, Hkv, M, 1] float32 (each row's attention-sink
    logit, or None) -> [B, Hkv, M, D]. K/V are never expanded."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)  # Gemma 2 (transformers' eager_attention_forward)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = s.softmax(-1)
    else:  # the sink joins the softmax as one more logit with no value (gpt-oss), then is dropped
        p = torch.cat([s, sinks.expand(*s.shape[:-1], 1)], -1).softmax(-1)[..., :-1]
    return torch.matmul(p, v.float()).to(q.dtype)


def _sink_rows(sinks: Optional[torch.Tensor], hkv: int, tokens: int) -> Optional[torch.Tensor]:
    """sinks [H] -> [1, Hkv, G * tokens, 1] float32 in _grouped_attention's row order (head, token)."""
    if sinks is None:
        return None
    g = sinks.shape[0] // hkv
    return sinks.float().view(hkv, g, 1).expand(hkv, g, tokens).reshape(1, hkv, g * tokens, 1)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int],
             chunk: Optional[int] = None) -> torch.Tensor:
    """[..., Tq, L] bool: key position j is visible from query position p (j <= p, and j > p - window,
    and j in p's chunk)."""
    m = k_pos <= q_pos.unsqueeze(-1)
    if window is not None:
        m &= k_pos > q_pos.unsqueeze(-1) - window
    if chunk is not None:
        m &= k_pos >= (q_pos.unsqueeze(-1) // chunk) * chunk
    return m


def gather_rows(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Slots ``slots`` of one half of a cache (``flat_cache``): [len(slots), Hkv, D] in ``dtype`` (an int8
    cache dequantized in float32 first)."""
    if kv_quant.is_int8(flat):
        return kv_quant.gather(flat, slots).to(dtype)
    return flat.index_select(0, slots)


def flat_cache(kv_cache: torch.Tensor, i: int) -> torch.Tensor:
    """K (i = 0) or V (i = -1: the keys in a one-plane cache) of a layer's cache as gather_rows reads it: [num_slots, Hkv, D] for a float
    cache; an int8 cache stays [num_blocks, block_size + S, Hkv, D] (its scales sit in each block)."""
    return kv_cache[i] if kv_quant.is_int8(kv_cache) else kv_cache[i].view(-1, *kv_cache.shape[-2:])


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    supports_bidirectional = True

    def forward(self, q, k, v, kv_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None, sinks=None,
                attention_chunk=None):
        out = torch.empty_like(q)
        if kv_cache is not None:
            write_kv(k, v, kv_cache, meta.slot_mapping)
            flat_k, flat_v = flat_cache(kv_cache, 0), flat_cache(kv_cache, -1)
        nd = meta.num_decode_tokens
        if nd:
            slots, k_pos = self._decode_slots(meta)
            b, length = slots.shape
            hkv, d = k.shape[1:]
            ck = gather_rows(flat_k, slots.view(-1), q.dtype).view(b, length, hkv, d).transpose(1, 2)
            cv = gather_rows(flat_v, slots.view(-1), q.dtype).view(b, length, hkv, d).transpose(1, 2)
            mask = _visible(meta.seq_lens[:nd].long() - 1, k_pos, sliding_window, attention_chunk).view(b, 1, 1, length)
            o = _grouped_attention(q[:nd].view(b, hkv, -1, d), ck, cv, mask, scale, logits_soft_cap,
                                   _sink_rows(sinks, hkv, 1))
            out[:nd] = o.reshape(b, -1, d)
        for i, p in enumerate(meta.prefills):
            out[p.query_start:p.query_end] = self.prefill(
                q, k, v, flat_k if kv_cache is not None else None, flat_v if kv_cache is not None else None,
                meta, nd + i, p, scale, sliding_window, logits_soft_cap, sinks=sinks, chunk=attention_chunk)
        return out

    @staticmethod
    def _decode_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded gather slots [B_d, L] of the decodes' contexts and key positions [L] (once per step)."""
        if "torch.decode" not in meta.derived:
            bs, nd = meta.block_size, meta.num_decode_tokens
            nblocks = -(-meta.max_decode_seq_len // bs)
            k_pos = torch.arange(nblocks * bs, device=meta.slot_mapping.device)
            tables = meta.block_tables[:nd, :nblocks].long()
            meta.derived["torch.decode"] = (tables[:, k_pos // bs] * bs + k_pos % bs, k_pos)
        return meta.derived["torch.decode"]

    @staticmethod
    def prefill(q, k, v, flat_k, flat_v, meta: AttentionMetadata, row: int, p: PrefillSeq, scale: float,
                 window: Optional[int], soft_cap: Optional[float], gather=gather_rows,
                 sinks: Optional[torch.Tensor] = None, chunk: Optional[int] = None) -> torch.Tensor:
        """[T, H, D] for one prompt chunk (batch row ``row`` of ``meta``), whose queries sit at positions
        seq_len - T .. seq_len - 1; flat_k/flat_v are the cache (``flat_cache``; None: no cache)."""
        plain = (window is None and soft_cap is None and sinks is None and chunk is None  # SDPA's causal mask does
                 and not p.bidirectional)
        t = p.query_end - p.query_start
        h, d = q.shape[1:]
        hkv = k.shape[1]
        qs = q[p.query_start:p.query_end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        # An int8 cache: the prompt's own K/V as the cache holds them (read back, dequantized).
        if flat_k is None or (not p.has_prefix and not kv_quant.is_int8(flat_k)):  # K/V all in this batch
            ks = k[p.query_start:p.query_end].transpose(0, 1).unsqueeze(0)
            vs = v[p.query_start:p.query_end].transpose(0, 1).unsqueeze(0)
            if plain:
                return _causal_sdpa(qs, ks, vs, scale).squeeze(0).transpose(0, 1)
        else:
            key = ("torch.prefill", row)
            if key not in meta.derived:
                bs = meta.block_size
                pos = torch.arange(p.seq_len, device=q.device)
                meta.derived[key] = meta.block_tables[row, pos // bs].long() * bs + pos % bs
            slots = meta.derived[key]
            ks = gather(flat_k, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            vs = gather(flat_v, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            if not p.has_prefix and plain:
                return _causal_sdpa(qs, ks, vs, scale).squeeze(0).transpose(0, 1)
        length = ks.shape[2]
        q_pos = torch.arange(length - t, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = _visible(q_pos, k_pos, window, chunk)
        for lo, hi in p.bidirectional:  # later keys of the query's own span (the window never hides them)
            mask |= (((q_pos >= lo) & (q_pos < hi)).unsqueeze(-1) & (k_pos > q_pos.unsqueeze(-1)) & (k_pos < hi))
        # Query heads of one KV head as rows: [1, Hkv, G * T, D], mask tiled per head of the group.
        o = _grouped_attention(qs.reshape(1, hkv, -1, d), ks, vs, mask.repeat(h // hkv, 1).view(1, 1, -1, length),
                               scale, soft_cap, _sink_rows(sinks, hkv, t))
        return o.reshape(h, t, d).transpose(0, 1)  # SDPA may return a non-contiguous layout (CUDA)
