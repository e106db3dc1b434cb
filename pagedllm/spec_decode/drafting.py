"""What the proposers with a model of their own (the draft model, the MTP layer) share: the flat batch of
one proposer pass (``FlatRows``, ``proposer_batch``; the speculator's verification batch is built with
the same ``FlatRows``), and drawing proposals from its logits under each request's
sampling parameters, so that the rejection sampler can verify them exactly (``draw_proposals``).

The logits go through the request's penalties, logit_bias, allowed and bad tokens (``Sampler.process``,
as the target's will: proposals the target would never take are not made), then temperature, top-k,
top-p and min-p (``target_probs``): q. A greedy request's proposal is q's argmax; another's is drawn
from q with the request's own generator where it is seeded, and q goes to the rejection sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.sampler import Sampler, SamplingRow, target_probs
from pagedllm.platforms import ops

if TYPE_CHECKING:
    from pagedllm.engine.request import Request


@dataclass
class FlatRows:
    """The flat token rows of a forward pass, built one sequence at a time: each sequence's new tokens
    as a query over its cached prefix, read and written through its block table."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)

    def add(self, toks: list[int], start: int, table: list[int], block_size: int) -> None:
        """One sequence: tokens ``toks`` at positions ``start`` .. ``start + len(toks) - 1``, slots
        from its block table ``table`` (physical block ids)."""
        n = len(toks)
        self.ids.extend(toks)
        self.positions.extend(range(start, start + n))
        self.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        self.tables.append(table)
        self.seq_lens.append(start + n)
        self.query_lens.append(n)

    def tensors(self, block_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [N] int64, positions [N] int64, the paged attention metadata); one-token
        sequences must have been added first (decodes before prefills, as the metadata reads them)."""
        meta = AttentionMetadata.build(torch.tensor(self.slots, dtype=torch.long, device=device), self.tables,
                                       self.seq_lens, self.query_lens, block_size, device)
        return (torch.tensor(self.ids, dtype=torch.long, device=device),
                torch.tensor(self.positions, dtype=torch.long, device=device), meta)


def proposer_batch(seqs: list[tuple[list[int], int, list[int]]], block_size: int, device: str
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """``seqs`` = (new tokens, first position, block table) per sequence, one-token ones first (a query of
    several tokens over the cached prefix for the others) -> (input_ids [N] int64, positions [N] int64,
    the paged attention metadata (slots from the tables), the row of each sequence's last token [S] int64)."""
    rows, last = FlatRows(), []
    for toks, start, table in seqs:
        rows.add(toks, start, table, block_size)
        last.append(len(rows.ids) - 1)
    return (*rows.tensors(block_size, device), torch.tensor(last, dtype=torch.long, device=device))


def draw_proposals(sampler: Sampler, logits: torch.Tensor, requests: list["Request"], out: dict[str, list[int]],
                   probs: dict[str, list[torch.Tensor]]) -> None:
    """One proposal per request, appended to ``out[request_id]`` (its proposals
    so far, which count as output for the penalties); for a sampled request q [V] float32 is appended to
    ``probs[request_id]``.

    Args:
        logits: [len(requests), V] float32, the proposer's raw logits at each request's next position.
    """
    greedy = [r.sampling_params.greedy for r in requests]
    rows = [SamplingRow(r.sampling_params, None, r.prompt_token_ids, r.output_token_ids + out[r.request_id])
            for r in requests]
    logits = sampler.process(logits, rows)
    tokens = ops.argmax_rows(logits).tolist()
    if not all(greedy):
        q = target_probs(logits, rows)
        for i, r in enumerate(requests):
            if not greedy[i]:
                tokens[i] = int(torch.multinomial(q[i], 1, generator=r.generator))
                probs[r.request_id].append(q[i])
    for r, tok in zip(requests, tokens):
        out[r.request_id].append(tok)
