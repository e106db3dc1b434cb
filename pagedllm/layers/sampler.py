"""Sampler: penalties, temperature, top-k, top-p (Holtzman et al., 2020), min-p (Nguyen et al.,
2024), greedy, seeded sampling and logprobs, for a batch of rows with per-row parameters.

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` (the exponential race, equivalent to
multinomial sampling); a seeded row draws its ``q`` from its own generator, so its tokens do not
depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Optional

import torch

from pagedllm.layers.logits_processors import LOGITS_PROCESSORS, keep_grammar_rows_alive, needs_logits_processors
from pagedllm.platforms import ops
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.matcher import GrammarMatcher


@dataclass(slots=True)
class SamplingRow:
    """One sequence's sampling inputs. Slots: the sampler reads ``plain_greedy`` of every row each step,
    and a slotted row is one small object (no attribute dict to look up, fewer cache lines)."""

    params: SamplingParams
    generator: Optional[torch.Generator]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Token ids that may not be sampled yet (EOS and stop token ids before min_tokens).
    banned_token_ids: Optional[list[int]] = None
    # Structured outputs: the sequence's grammar state (the engine advances it after sampling).
    grammar: Optional["GrammarMatcher"] = None
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        # Greedy with nothing to apply first and no logprobs: its token is the argmax of its logits row.
        self.plain_greedy = (p.greedy and p.logprobs is None and not p.has_penalties
                             and not needs_logits_processors(self))


_PLAIN_GREEDY = attrgetter("plain_greedy")


@dataclass
class SamplerOutput:
    """``token_ids`` [B]; for rows that asked for logprobs: ``logprobs[i]`` =
    (sampled token logprob, its rank, top token ids, top logprobs), else None. ``token_tensor``: the same
    ids as an int64 [B] tensor on the logits' device (on a CPU ``.numpy()`` is free), where the sampler made one."""

    token_ids: list[int]
    logprobs: list[Optional[tuple[float, int, list[int], list[float]]]]
    token_tensor: Optional[torch.Tensor] = None


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty (Keskar et al., 2019; over prompt + output, divides positive logits)
    and OpenAI presence/frequency penalties (over output tokens) on ``logits`` [B, V], in place."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        sp = row.params
        if not sp.has_penalties:
            continue
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long, device=logits.device)
            seen = seen[(seen >= 0) & (seen < vocab)].unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if out.numel() and (sp.frequency_penalty or sp.presence_penalty):
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set. logits [B, V]."""
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        remove = ranks >= k.unsqueeze(1)
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Drop a token when the mass of the tokens strictly before it already reaches top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
        remove[:, 0] = False
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from: ``logits`` [B, V] after ``Sampler.process``, divided by
    the temperature (1 for a greedy row), top-k / top-p / min-p applied, softmax -> float32 [B, V]
    (what ``Sampler.__call__`` draws from; speculative decoding's rejection sampler verifies against it)."""
    dev = logits.device
    temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], device=dev)
    scaled = logits / temps.unsqueeze(1)
    top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
    return _top_k_top_p_min_p(scaled, top_k, top_p, min_p).softmax(dim=-1)


class Sampler:
    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Penalties and the logits processors (min_tokens bans, logit_bias, allowed ids, bad words,
        grammar) on float32 ``logits`` [B, V]; a copy where anything applies (the input is left as is)."""
        penalize = any(r.params.has_penalties for r in rows)
        process = any(needs_logits_processors(r) for r in rows)
        if penalize or process:
            logits = logits.clone()  # logits come from inference mode: edit one copy
        if penalize:
            logits = apply_penalties(logits, rows)
        if process:
            # Only a grammar row that other processors also mask can end up with no token left.
            raw = logits.clone() if any(r.grammar is not None and (r.banned_token_ids or r.params.has_logits_processors)
                                        for r in rows) else None
            for processor in LOGITS_PROCESSORS:
                processor(logits, rows)
            if raw is not None:
                logits = keep_grammar_rows_alive(logits, raw, rows)
        return logits

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 all_plain_greedy: Optional[bool] = None) -> SamplerOutput:
        """logits [B, V] (float32, one row per sequence that samples this step). ``all_plain_greedy``:
        whether every row is ``plain_greedy``, where the caller keeps that (None: read here, a row at a
        time); a wrong True would skip what the other rows ask for."""
        logits = logits.float()
        if all_plain_greedy is None:
            all_plain_greedy = all(map(_PLAIN_GREEDY, rows))
        if all_plain_greedy:  # (what the general path below gives such a batch)
            tokens = ops.argmax_rows(logits)
            return SamplerOutput(tokens.tolist(), [None] * len(rows), tokens)
        need_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(need_logprobs) else None
        logits = self.process(logits, rows)

        greedy = [r.params.greedy for r in rows]
        tokens = ops.argmax_rows(logits)
        if not all(greedy):
            dev = logits.device
            probs = target_probs(logits, rows)
            q = torch.empty_like(probs)
            unseeded = [i for i, r in enumerate(rows) if r.generator is None]
            if unseeded:
                q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_()
            for i, r in enumerate(rows):
                if r.generator is not None:
                    q[i].exponential_(generator=r.generator)
            sampled = ops.argmax_rows(probs / q)
            tokens = torch.where(torch.tensor(greedy, device=dev), tokens, sampled)

        token_list = tokens.tolist()
        logprobs: list = [None] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is None:
                    continue
                logprobs[i] = topk_logprobs(raw_logprobs[i], token_list[i], r.params.logprobs)
        return SamplerOutput(token_list, logprobs, tokens)


def topk_logprobs(row_logprobs: torch.Tensor, token_id: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """(logprob of ``token_id``, its 1-based rank, top-k ids, top-k logprobs) of one row [V]."""
    lp = row_logprobs[token_id]
    rank = int((row_logprobs > lp).sum().item()) + 1
    if k > 0:
        vals, ids = row_logprobs.topk(min(k, row_logprobs.shape[-1]))
        return float(lp), rank, ids.tolist(), vals.tolist()
    return float(lp), rank, [], []
