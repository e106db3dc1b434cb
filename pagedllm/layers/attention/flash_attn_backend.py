"""Paged attention through the ``flash_attn`` library (FlashAttention-2, Dao 2023), where it is installed:
``--attention-backend flash-attn``. Not a dependency of pagedllm; without it the backend refuses with
"flash_attn is not installed".

The library reads K/V in place through our block table (its paged KV cache: ``block_table``), in
the cache layout pagedllm already has ([num_blocks, block_size, Hkv, D] per plane, FlashAttention's
"NHD"), with grouped-query attention, sliding windows (``window_size``) and soft-caps (``softcap``):

- decodes: ``flash_attn_with_kvcache`` on [B_d, 1, H, D] with ``cache_seqlens`` = seq_lens (the step's
  K/V are written first, by ``write_kv``, so the library appends nothing). Only tensors go in: a
  decode-only step can be captured in a CUDA graph (``platforms/cuda/graph_runner.py``).
- prefills (and chunks over a cached prefix): one ``flash_attn_varlen_func`` call over all of them with
  ``block_table`` (flash-attn >= 2.6), causal aligned to the end of each sequence's keys.

Refused by name: a device other than CUDA, dtypes other than fp16/bf16, head_dim over 256 or not a
multiple of 8, a block size that is not a multiple of 256 (FlashAttention-2's paged cache takes pages
of a multiple of 256 tokens: run with ``--block-size 256``), and at run time the int8 KV cache,
attention sinks, Llama 4's chunked attention and MLA's one-plane cache (the torch and triton backends
take those).
"""
from __future__ import annotations

import importlib.util
import inspect
from typing import Optional

import torch

from pagedllm.layers.attention import kv_quant
from pagedllm.layers.attention.backend import AttentionBackend, write_kv

LIBRARY = "flash_attn"


def _library():
    """The ``flash_attn`` module (imported on first use)."""
    import flash_attn  # lazily: flash_attn is an optional library (and needs CUDA)

    return flash_attn


def unsupported_features(kv_cache: Optional[torch.Tensor], sinks, attention_chunk) -> Optional[str]:
    """The first per-call feature the library backends (flash-attn, flashinfer) do not take, else None."""
    if kv_cache is None:
        return "a step without a KV cache (the profiling pass)"
    if kv_quant.is_int8(kv_cache):
        return "the int8 KV cache (--kv-cache-dtype int8)"
    if kv_cache.shape[0] != 2:
        return "a one-plane cache (multi-head latent attention)"
    if sinks is not None:
        return "attention sinks (gpt-oss)"
    if attention_chunk is not None:
        return "chunked attention (Llama 4)"
    return None


class FlashAttnPagedAttention(AttentionBackend):
    name = "flash-attn"
    needs_zeroed_cache = False  # reads only the first seq_len slots of each sequence

    @classmethod
    def unsupported_reason(cls, *, device: str, dtype: torch.dtype, head_dim: int,
                           block_size: int) -> Optional[str]:
        if importlib.util.find_spec(LIBRARY) is None:
            return "flash_attn is not installed (pip install flash-attn)"
        if torch.device(device).type != "cuda":
            return "flash_attn runs on CUDA only"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash_attn takes float16 and bfloat16, not {str(dtype).replace('torch.', '')}"
        if head_dim > 256 or head_dim % 8:
            return f"flash_attn takes head_dim <= 256 and a multiple of 8, not {head_dim}"
        if block_size % 256:
            return f"flash_attn's paged KV cache needs a block size that is a multiple of 256 (got {block_size}: " \
                   f"--block-size 256)"
        if "block_table" not in inspect.signature(_library().flash_attn_varlen_func).parameters:
            return f"flash_attn {getattr(_library(), '__version__', '?')} has no paged varlen entry (needs >= 2.6)"
        return None

    def forward(self, q, k, v, kv_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None, sinks=None,
                attention_chunk=None):
        why = unsupported_features(kv_cache, sinks, attention_chunk)
        if why is not None:
            raise ValueError(f"attention backend 'flash-attn' does not support {why}; use --attention-backend "
                             f"torch or triton")
        fa = _library()
        write_kv(k, v, kv_cache, meta.slot_mapping)
        kc, vc = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        # A query at position p sees p - W < j <= p: W - 1 keys to its left (FlashAttention's window_size).
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        cap = float(logits_soft_cap or 0.0)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            o = fa.flash_attn_with_kvcache(q[:nd].unsqueeze(1), kc, vc, cache_seqlens=meta.seq_lens[:nd],
                                           block_table=meta.block_tables[:nd], softmax_scale=scale, causal=True,
                                           window_size=window, softcap=cap)
            out[:nd] = o.squeeze(1)
        if meta.prefills:
            first, last = meta.prefills[0].query_start, meta.prefills[-1].query_end
            seq_lens = meta.seq_lens[nd:]
            cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
            cu_k[1:] = torch.cumsum(seq_lens, 0, dtype=torch.int32)
            o = fa.flash_attn_varlen_func(
                q[first:last], kc, vc, cu_seqlens_q=meta.query_start_loc[nd:] - first, cu_seqlens_k=cu_k,
                max_seqlen_q=max(p.query_end - p.query_start for p in meta.prefills),
                max_seqlen_k=max(p.seq_len for p in meta.prefills), softmax_scale=scale, causal=True,
                window_size=window, softcap=cap, block_table=meta.block_tables[nd:])
            out[first:last] = o
        return out
