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

import llguidance
import torch

logger = logging.getLogger("pagedllm")

_executor = None


class GrammarMatcher:
    """``vocab_size``: the width of the grammar's token masks (the larger of the model's logits and
    the tokenizer's length: a GGUF tokenizer may carry a token the model has no logit for);
    ``eos_token_id``: the one token a failed matcher's mask allows."""

    def __init__(self, ll_matcher, vocab_size: int = 0, eos_token_id: Optional[int] = None) -> None:
        self._m = ll_matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        # The grammar can no longer follow the output (it rejected a token, or llguidance hit one of
        # its limits: "too many expressions constructed", a row of over 2,000 items): the engine
        # then ends the request with finish_reason "abort" rather than go on unconstrained (vLLM's
        # llguidance backend ends it with EOS instead).
        self.failed = False

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (the matcher failed, logged once) when the grammar
        rejects it."""
        if self.failed:
            return True
        if self.check_error("before a token"):
            return False
        if self._m.is_stopped():
            return True
        if not self._m.consume_token(token_id):
            self.failed = True
            # The error's first line (llguidance appends its state and the whole grammar)
            logger.warning("structured output: token %d rejected by the grammar (%s); the request is aborted",
                           token_id, (self._m.get_error() or "").strip().split("\n", 1)[0])
            return False
        return True

    def check_error(self, where: str) -> bool:
        """Fail (logged once) if llguidance put the matcher in its error state: a limit hit while
        computing a mask ("Too many items (limit 50000; mask)", lexer states) leaves it there, with a
        mask that allows only EOS, which would end the request as an ordinary stop."""
        if self.failed:
            return True
        if not self._m.is_error():
            return False
        self.failed = True
        logger.warning("structured output: the grammar failed %s (%s); the request is aborted", where,
                       (self._m.get_error() or "").strip().split("\n", 1)[0])
        return True

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()


def fill_bitmask(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """int32 bitmask [len(matchers), ceil(vocab_size / 32)] of the tokens each matcher allows
    next, computed in parallel by llguidance's thread pool. A matcher whose mask cannot be
    computed fails (one request's grammar does not lift another's mask); a failed matcher allows
    only EOS, and the engine aborts its request after this step."""
    import llguidance.torch  # lazily: 2.4 s to import (it sets up torch.compile), paid by the first grammar only

    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    vocab_size = max([vocab_size] + [m.vocab_size for m in matchers])  # apply_bitmask cuts it to the logits
    mask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    live = [(m._m, i) for i, m in enumerate(matchers) if not m.failed]
    if live:
        try:
            llguidance.torch.fill_next_token_bitmask_par(_executor, live, mask)
        except Exception as e:  # noqa: BLE001 - one request's grammar must not stop the engine
            logger.warning("structured output: computing the token masks failed (%s: %s); one request at a time",
                           type(e).__name__, e)
            for ll, i in live:
                try:
                    llguidance.torch.fill_next_token_bitmask(ll, mask, i)
                except Exception as e1:  # noqa: BLE001
                    logger.warning("structured output: computing the token mask failed (%s: %s); the request "
                                   "is aborted", type(e1).__name__, e1)
                    matchers[i].failed = True
    for i, m in enumerate(matchers):
        if m.failed or m.check_error("computing its token mask"):
            mask[i].zero_()
            eos = m.eos_token_id
            if eos is not None and 0 <= eos < vocab_size:
                mask[i, eos // 32] = torch.tensor(1 << (eos % 32), dtype=torch.int64).to(torch.int32)
    return mask


_BYTE_PENALTY: dict = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None) -> None:
    """Set to -inf, in place, the logits [B, V] of tokens whose bit is 0 in ``bitmask`` [R, W]
    (row r of the bitmask applies to logits row ``rows[r]``; all rows when None).

    The int32 words are read as little-endian bytes (token t = bit t % 8 of byte t // 8); each
    byte selects a row of a 256 x 8 table of 0 / -inf that is added to the logits: one
    index_select and one add, several times faster on CPU than unpacking bits and masked_fill."""
    dev = logits.device
    vocab = logits.shape[1]
    key = (dev, logits.dtype)
    table = _BYTE_PENALTY.get(key)
    if table is None:
        b = torch.arange(256, dtype=torch.int32)
        bits = ((b.unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1).bool()
        table = _BYTE_PENALTY[key] = torch.zeros(256, 8, dtype=logits.dtype).masked_fill_(~bits, float("-inf")).to(dev)
    as_bytes = bitmask.contiguous().view(torch.uint8).to(dev, non_blocking=True).long()      # [R, 4W]
    penalty = table.index_select(0, as_bytes.flatten()).view(as_bytes.shape[0], -1)       # [R, 32W]
    if penalty.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        pad = torch.full((penalty.shape[0], vocab - penalty.shape[1]), float("-inf"), dtype=logits.dtype, device=dev)
        penalty = torch.cat([penalty, pad], dim=1)
    penalty = penalty[:, :vocab]
    if rows is None or rows == list(range(logits.shape[0])):
        logits.add_(penalty)
    else:
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        logits.index_add_(0, idx, penalty)
