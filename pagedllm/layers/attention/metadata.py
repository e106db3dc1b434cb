"""Per-step batch layout that every attention layer of a step shares (built once per step in
``engine/input_batch.py``).

Paged attention (Kwon et al., SOSP 2023): the K/V of token position p of a sequence sit in slot
``block_table[p // block_size] * block_size + p % block_size`` of the layer's KV cache
``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class PrefillSeq:
    """One sequence with more than one new token in this step (a prompt or a prompt chunk):
    ``query_start``/``query_end`` index the flat batch; ``seq_len`` counts all its tokens with K/V
    after this step (cached prefix + new)."""

    query_start: int
    query_end: int
    seq_len: int
    # Spans [lo, hi) of sequence positions whose tokens also see each other's later tokens (Gemma 3's
    # image tokens attend bidirectionally within one image; transformers' token_type_ids mask): a query
    # at p in a span sees keys up to hi - 1. Empty: plain causal attention.
    bidirectional: tuple[tuple[int, int], ...] = ()

    @property
    def has_prefix(self) -> bool:
        return self.seq_len > self.query_end - self.query_start


@dataclass
class AttentionMetadata:
    """The flat batch of one step: B sequences, decodes (one new token each) first, then prefills.

    Shared by all backends (vLLM's ``query_start_loc``/``seq_lens``/``block_table`` names):

    - ``slot_mapping`` [N] int64: where each new token's K/V are written.
    - ``num_decode_tokens``: the first ``num_decode_tokens`` tokens are B_d one-token sequences.
    - ``prefills``: the multi-token sequences that follow, with host-side offsets.
    - ``block_tables`` [B, max_blocks] int32 (padded with 0), ``seq_lens`` [B] int32 (tokens with
      K/V after this step), ``query_start_loc`` [B + 1] int32 (row offsets into the flat batch).
      None only in the KV-cache-less profiling pass.
    - ``block_size``; ``max_decode_seq_len`` (host int) = max ``seq_lens`` over the decodes.

    ``derived`` holds what a backend computes from this layout once per step (e.g. the torch
    reference's gather slots), keyed by the backend; the first layer builds it, the rest reuse it.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_tables: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    query_start_loc: Optional[torch.Tensor] = None
    block_size: int = 0
    max_decode_seq_len: int = 0
    derived: dict[Any, Any] = field(default_factory=dict)

    @property
    def has_bidirectional(self) -> bool:
        """Whether a prefill has bidirectional spans (backends without them fall back to the torch
        reference for those sequences; the CPU layer runner sits such steps out)."""
        return any(p.bidirectional for p in self.prefills)

    @property
    def num_seqs(self) -> int:
        return self.num_decode_tokens + len(self.prefills)

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_tables: list[list[int]], seq_lens: list[int],
              query_lens: list[int], block_size: int, device) -> "AttentionMetadata":
        """The step's metadata from per-sequence block tables (physical block ids), lengths after
        this step and new-token counts, in batch order (all one-token sequences first)."""
        nd = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if any(n == 1 for n in query_lens[nd:]):
            raise ValueError("decodes (one new token) must come before prefills in the batch")
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        max_blocks = max((len(t) for t in block_tables), default=0)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
        return cls(slot_mapping=slot_mapping, num_decode_tokens=nd,
                   prefills=[PrefillSeq(starts[i], starts[i + 1], seq_lens[i]) for i in range(nd, len(seq_lens))],
                   block_tables=tables.view(len(block_tables), max_blocks).to(device),
                   seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                   block_size=block_size, max_decode_seq_len=max(seq_lens[:nd], default=0))
