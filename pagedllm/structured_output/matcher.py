"""Per-sequence grammar state and the batched token bitmask.

A matcher follows one sequence's output: the engine calls ``accept`` with every token it samples
for that sequence, so the state always equals "the output so far". Preemption by recompute keeps
the output tokens, hence the matcher too; prefill chunks sample nothing, so no mask is computed
until the last prompt chunk. The bitmask has one bit per token (int32 words, bit ``t % 32`` of word
``t // 32``), the layout of llguidance and xgrammar.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

logger = logging.getLogger("pagedllm")

_executor = None


class GrammarMatcher:
    def __init__(self, ll_matcher) -> None:
        self._m = ll_matcher
        self.failed = False

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and logged once) when the grammar rejects it."""
        if self.failed or self._m.is_stopped():
            return True
        if not self._m.consume_token(token_id):
            self.failed = True
            logger.warning("structured output: token %d rejected by the grammar (%s); mask lifted",
                           token_id, self._m.get_error())
            return False
        return True

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()


def fill_bitmask(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """int32 bitmask [len(matchers), ceil(vocab_size / 32)] of the tokens each matcher allows
    next, computed in parallel by llguidance's thread pool. A failed matcher allows every token."""
    import llguidance
    import llguidance.torch

    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    mask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    live = [(m._m, i) for i, m in enumerate(matchers) if not m.failed]
    if live:
        llguidance.torch.fill_next_token_bitmask_par(_executor, live, mask)
    return mask


_SHIFTS: dict = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None) -> None:
    """Set to -inf, in place, the logits [B, V] of tokens whose bit is 0 in ``bitmask`` [R, W]
    (row r of the bitmask applies to logits row ``rows[r]``; all rows when None)."""
    dev = logits.device
    vocab = logits.shape[1]
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    bits = (bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> shifts) & 1   # [R, W, 32]
    allowed = bits.flatten(1).bool()
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=dev)
        allowed = torch.cat([allowed, pad], dim=1)
    allowed = allowed[:, :vocab]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
