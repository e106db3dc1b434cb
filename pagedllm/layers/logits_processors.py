"""Per-request logits processors, applied by the sampler in a fixed order, each batched over the
rows that use it (vLLM v1: ``vllm/v1/sample/logits_processor``, ``vllm/v1/sample/ops/bad_words.py``,
and the grammar bitmask of ``vllm/v1/structured_output``).

Order: min_tokens bans -> logit_bias (one scatter-add) -> allowed_token_ids (one boolean mask) ->
bad_words (one scatter of -inf) -> grammar bitmask. A processor is ``fn(logits, rows)`` editing
``logits`` [B, V] (float32, already a private copy) in place; add one to ``LOGITS_PROCESSORS``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pagedllm.structured_output.matcher import apply_bitmask, fill_bitmask

if TYPE_CHECKING:
    from pagedllm.layers.sampler import SamplingRow


def _ban(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        rows_idx, tok_idx = zip(*pairs)
        logits[list(rows_idx), list(tok_idx)] = float("-inf")


def apply_min_tokens(logits: torch.Tensor, rows: list["SamplingRow"]) -> None:
    """EOS and stop token ids cannot be sampled before ``min_tokens`` outputs."""
    vocab = logits.shape[-1]
    _ban(logits, [(i, t) for i, r in enumerate(rows) for t in (r.banned_token_ids or ()) if 0 <= t < vocab])


def apply_logit_bias(logits: torch.Tensor, rows: list["SamplingRow"]) -> None:
    """Add each row's ``logit_bias`` values: one scatter-add over the batch."""
    r_idx, t_idx, vals = [], [], []
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        for t, v in (r.params.logit_bias or {}).items():
            if 0 <= t < vocab:
                r_idx.append(i)
                t_idx.append(t)
                vals.append(v)
    if vals:
        dev = logits.device
        logits.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, rows: list["SamplingRow"]) -> None:
    """Only ``allowed_token_ids`` survive: one boolean mask over the rows that set them."""
    which = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if not which:
        return
    vocab = logits.shape[-1]
    keep = torch.zeros(len(which), vocab, dtype=torch.bool)
    for j, i in enumerate(which):
        ids = [t for t in rows[i].params.allowed_token_ids if 0 <= t < vocab]
        keep[j, ids] = True
    idx = torch.tensor(which, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~keep.to(logits.device), float("-inf"))


def bad_word_bans(output_token_ids: list[int], bad_words_token_ids: list[list[int]]) -> list[int]:
    """Tokens to ban next: the last token of each bad word whose preceding tokens end the output."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def apply_bad_words(logits: torch.Tensor, rows: list["SamplingRow"]) -> None:
    vocab = logits.shape[-1]
    _ban(logits, [(i, t) for i, r in enumerate(rows) if r.params.bad_words_token_ids
                  for t in bad_word_bans(r.output_token_ids, r.params.bad_words_token_ids) if 0 <= t < vocab])


def apply_grammar(logits: torch.Tensor, rows: list["SamplingRow"]) -> None:
    """Structured outputs: each constrained row keeps only the tokens its grammar allows next."""
    which = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not which:
        return
    mask = fill_bitmask([rows[i].grammar for i in which], logits.shape[-1])
    apply_bitmask(logits, mask, which)


def keep_grammar_rows_alive(logits: torch.Tensor, raw: torch.Tensor, rows: list["SamplingRow"]) -> torch.Tensor:
    """A constrained row whose every token got masked (say the grammar allows only EOS while
    min_tokens bans it) falls back to the grammar mask alone: the output must stay valid."""
    which = [i for i, r in enumerate(rows) if r.grammar is not None]
    alive = torch.isfinite(logits[which]).any(dim=1).tolist()
    dead = [i for i, ok in zip(which, alive) if not ok]
    if dead:
        sub = raw[dead].clone()
        apply_grammar(sub, [rows[i] for i in dead])
        logits[dead] = sub
    return logits


LOGITS_PROCESSORS: list[Callable[[torch.Tensor, list["SamplingRow"]], None]] = [
    apply_min_tokens, apply_logit_bias, apply_allowed_token_ids, apply_bad_words, apply_grammar]


def needs_logits_processors(row: "SamplingRow") -> bool:
    return bool(row.banned_token_ids) or row.grammar is not None or row.params.has_logits_processors
