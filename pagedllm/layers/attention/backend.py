"""The attention-backend interface (vLLM's plug point, ``vllm/v1/attention/backend.py``): each
backend says which setups it supports and why it refuses the others, and computes attention for
the flat batch of one step."""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.layers.attention import kv_quant
from pagedllm.layers.attention.metadata import AttentionMetadata


class AttentionBackend:
    """Computes attention for the flat batch: q [N, H, D], k/v [N, Hkv, D] (this step's new
    tokens, written into ``kv_cache`` by ``meta.slot_mapping`` first) -> [N, H, D] in q's dtype.
    ``kv_cache`` [2, num_blocks, block_size, Hkv, D] in q's dtype, or the int8 cache of
    ``kv_quant.py`` [2, num_blocks, block_size + S, Hkv, D] (values, then the block's scales).
    A cache of one plane, [1, ...], holds keys that are also the values (multi-head latent
    attention's latent, ``models/deepseek_v2.py``): v must then be k, and is read from the keys.

    Head h reads KV head ``h // (H // Hkv)`` (grouped-query attention, transformers' ``repeat_kv``).
    ``sliding_window`` W: a query at position p sees keys at positions p - W < j <= p (transformers'
    ``sliding_window_overlay``; Mistral, Gemma 2/3). ``logits_soft_cap`` c: scores
    ``c * tanh(q.k * scale / c)`` before the softmax (Gemma 2). ``sinks`` [H] (float): attention
    sinks (gpt-oss; Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"),
    one learned logit per query head that joins the softmax's denominator and carries no value.
    ``attention_chunk`` C: a query at position p sees keys in its own chunk, floor(p / C) * C <= j <= p
    (Llama 4's chunked attention; transformers' ``create_chunked_causal_mask``).
    """

    name = "base"
    # True when the backend may read slots no sequence has written (then they must hold finite values).
    needs_zeroed_cache = True
    # Whether it honours PrefillSeq.bidirectional (Gemma 3's image spans); a step with such spans runs
    # the torch reference where not (``bidirectional_fallback``).
    supports_bidirectional = False

    @classmethod
    def unsupported_reason(cls, *, device: str, dtype: torch.dtype, head_dim: int,
                           block_size: int) -> Optional[str]:
        """None when this backend runs the setup, else a short reason why not."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, scale: float, *, sliding_window: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                attention_chunk: Optional[int] = None) -> torch.Tensor:
        raise NotImplementedError


class SlidingWindowBackend(AttentionBackend):
    """Passes ``sliding_window`` to ``inner`` on every call, for attention blocks (Llama's) that do
    not pass one (Phi-3: every layer attends within ``config.sliding_window``)."""

    def __init__(self, inner: AttentionBackend, window: int) -> None:
        self.inner, self.window = inner, window
        self.name, self.needs_zeroed_cache = inner.name, inner.needs_zeroed_cache
        self.supports_bidirectional = inner.supports_bidirectional

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, scale: float, **kw: Any) -> torch.Tensor:
        return self.inner.forward(q, k, v, kv_cache, meta, scale, **{"sliding_window": self.window, **kw})


def attention_window(attn: Any) -> Optional[int]:
    """The sliding window of attention module ``attn``: its backend's (``SlidingWindowBackend``),
    else its ``sliding_window`` attribute (Gemma 2/3's); None: it sees the whole context."""
    backend = getattr(attn, "backend", None)
    if isinstance(backend, SlidingWindowBackend):
        return backend.window or None
    return getattr(attn, "sliding_window", None) or None


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V [N, Hkv, D] into their slots of the paged cache (before reading, so a
    sequence's new tokens attend to themselves through the cache); an int8 cache quantizes them
    (``kv_quant.py``)."""
    planes = ((k, v) if kv_cache.shape[0] == 2 else (k,))  # one plane: the keys are the values
    for i, x in enumerate(planes):
        if kv_quant.is_int8(kv_cache):
            kv_quant.write(x, kv_cache[i], slot_mapping)
        else:
            kv_cache[i].view(-1, *kv_cache.shape[-2:]).index_copy_(0, slot_mapping, x)
