"""Builds one step's flat batch from the scheduler's plan: input_ids, positions, slot_mapping,
the attention metadata (block tables, sequence lengths, query offsets; built once per step and
shared by every layer), and which rows of the output need logits.

Batch order: one-token sequences (decodes) first, then multi-token chunks (prefills).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.worker.model_input import ModelInput


@dataclass
class StepPlan:
    """Driver-side bookkeeping that maps logits rows back to requests."""

    model_input: ModelInput
    sampling_requests: list[Request]
    # (request, first prompt position whose logprob is computed, number of positions)
    prompt_logprob_spans: list[tuple[Request, int, int]] = field(default_factory=list)


def prepare_inputs(out: SchedulerOutput, kv: KVCacheManager, device: str,
                   forks: dict[str, list[Request]] | None = None) -> StepPlan:
    """``forks``: leader id -> samples that fork from it once its prompt is done; they sample
    from the leader's logits row in the same step."""
    bs = kv.block_size
    decodes = [(r, n) for r, n in out.scheduled if n == 1]
    prefills = [(r, n) for r, n in out.scheduled if n > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    sample_idx: list[int] = []
    sampling_requests: list[Request] = []
    plp_idx: list[int] = []
    plp_spans: list[tuple[Request, int, int]] = []

    def note_outputs(r: Request, start: int, n: int, offset: int) -> None:
        if start + n == r.num_tokens:
            for s in [r, *(forks or {}).get(r.request_id, ())]:
                sample_idx.append(offset + n - 1)
                sampling_requests.append(s)
        if r.sampling_params.prompt_logprobs is not None:
            # Logits at position j give the logprob of prompt token j + 1.
            first = max(start, len(r.prompt_logprobs) - 1)
            last = min(start + n, r.num_prompt_tokens - 1)
            if last > first:
                plp_idx.extend(range(offset + first - start, offset + last - start))
                plp_spans.append((r, first + 1, last - first))

    tables: list[list[int]] = []  # per sequence, in batch order
    seq_lens: list[int] = []
    query_lens: list[int] = []
    for r, n in decodes + prefills:
        start = r.num_computed_tokens
        offset = len(input_ids)
        table = kv.get_block_ids(r.request_id)
        note_outputs(r, start, n, offset)
        input_ids.extend(r.all_token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        tables.append(table)
        seq_lens.append(start + n)
        query_lens.append(n)
    meta = AttentionMetadata.build(torch.tensor(slot_mapping, dtype=torch.long, device=device), tables, seq_lens,
                                   query_lens, bs, device)
    model_input = ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn_metadata=meta,
        logits_indices=torch.tensor(sample_idx + plp_idx, dtype=torch.long, device=device),
        block_copies=kv.take_pending_copies(),
    )
    return StepPlan(model_input, sampling_requests, plp_spans)
