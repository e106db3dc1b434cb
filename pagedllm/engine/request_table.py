"""The scheduler's persistent request table: the running decode batch's bookkeeping in arrays.

A steady decode batch (every running request has one token to compute, and nothing joins, leaves
or needs a block) asks the same of the scheduler every step: each request gets its one token, its
computed count grows by one, and its sampled token is appended and tested against its stop ids and
length cap. The table keeps, per row (the running requests, in the running list's order), what
those decisions read, so that a step is a handful of array operations plus one short loop of token
appends; only the rows the arrays flag (a block to allocate, a token that may stop the request) go
through the per-request Python (``Scheduler._schedule_table_rows`` / ``_update_table_rows``).

Rows are *known* when their mirrors are current and the request is a plain decode: RUNNING, one
token to compute (``num_tokens == num_computed_tokens + 1``), past its prompt (so it has sampled
before: no first-token bookkeeping, no prompt logprobs, no image chunk, no forks waiting on it), no
speculative proposals. A row that joins, or any row after a step the table did not drive (the
scheduler's general path), is read again from its request (``refresh``) before the table is trusted.

The stop test is a superset filter: ``stop_lut[token]`` is True for every id any row ever added can
stop on (eos, stop_token_ids, generation-config eos), so the precise test (``Scheduler._check_stop``)
runs only for flagged rows; a stale id only costs one precise test. vLLM V1 keeps the same kind of
per-row state in its persistent batch (``gpu_input_batch.py``: ``num_computed_tokens_cpu`` ...).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pagedllm.engine.request import Request


class RequestTable:
    """Per-row mirrors of the running requests (row i = ``rows[i]``), valid where ``known[i]``.

    Arrays (R rows preallocated, grown as needed):
        ``computed`` [R] int64: ``Request.num_computed_tokens``;
        ``free_end`` [R] int64: ``Request.kv_free_end`` (tokens the KV manager holds room for with
            nothing to do: a row needs ``allocate_slots`` when ``computed + 1 > free_end``);
        ``check_from`` [R] int64: from this computed count on every token of the row goes to the precise
            stop test: ``Request.length_cap`` - 1 (after the token's append, num_tokens = computed + 1
            reaches the cap), or -1 for a row whose every token is checked (a grammar);
        ``known`` [R] bool: the row's mirrors are current and it is a plain decode (module docstring).
    ``stop_lut`` [V] bool over token ids (V = the largest stop id seen + 2, so its last entry is False
    and ``take(..., mode="clip")`` maps any larger sampled id to False).

    ``rows`` is replaced, never modified (``SchedulerOutput.table_rows`` and the input batch hold it).
    """

    def __init__(self, capacity: int = 8) -> None:
        cap = max(1, capacity)
        self.computed = np.zeros(cap, np.int64)
        self.free_end = np.zeros(cap, np.int64)
        self.check_from = np.zeros(cap, np.int64)
        self.known = np.zeros(cap, bool)
        self._flag = np.zeros(cap, bool)  # scratch
        self.stop_lut = np.zeros(2, bool)
        self.rows: list[Request] = []
        self.row_of: dict[Request, int] = {}
        self._scheduled: Optional[list[tuple[Request, int]]] = None  # [(r, 1) for r in rows], kept
        self._stale = False  # invalidate() was called: no row is known (applied by the next sync)

    # ---- rows ---------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Every row is read from its request before the table is trusted again (a flag: the general
        path calls this every step, so it costs no array write until the table is used)."""
        self._stale = True

    def sync(self, running: list[Request]) -> None:
        """Rows := ``running`` (same order): rows of requests that stay are gathered, joining rows
        are unknown. Only the stale flag is applied when the rows are already those (list equality:
        identity first)."""
        if self._stale:
            self.known[:] = False
            self._stale = False
        if running == self.rows:
            return
        n = len(running)
        if n > len(self.computed):
            self._grow(2 * n)
        row_of = self.row_of
        src = np.fromiter([row_of.get(r, -1) for r in running], np.int64, n)
        stay = src >= 0
        src[~stay] = 0
        for a in (self.computed, self.free_end, self.check_from):
            a[:n] = a[src]
        self.known[:n] = self.known[src] & stay
        self.known[n:] = False
        self.rows = list(running)
        self.row_of = dict(zip(self.rows, range(n)))
        self._scheduled = None
        if not n:  # nothing runs: forget the stop ids of requests gone
            self.stop_lut = np.zeros(2, bool)

    def refresh(self, rows: list[int], reqs: list[Request]) -> None:
        """Rows ``rows`` read from their requests ``reqs`` (the caller has checked they are plain decodes):
        one write per array."""
        self.computed[rows] = [r.num_computed_tokens for r in reqs]
        self.free_end[rows] = [r.kv_free_end for r in reqs]
        self.check_from[rows] = [-1 if r.grammar is not None else r.length_cap - 1 for r in reqs]
        stop_ids = set().union(*[r.stop_ids for r in reqs])
        if stop_ids:
            top = max(stop_ids)
            if top + 2 > len(self.stop_lut):
                lut = np.zeros(top + 2, bool)
                lut[:len(self.stop_lut)] = self.stop_lut
                self.stop_lut = lut
            self.stop_lut[list(stop_ids)] = True
        self.known[rows] = True

    def scheduled(self) -> list[tuple[Request, int]]:
        """``[(r, 1) for r in rows]``, the same list while the rows stay (callers must not modify it)."""
        if self._scheduled is None:
            self._scheduled = [(r, 1) for r in self.rows]
        return self._scheduled

    def _grow(self, rows: int) -> None:
        for name in ("computed", "free_end", "check_from", "known", "_flag"):
            old = getattr(self, name)
            new = np.zeros(rows, old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    # ---- one step -----------------------------------------------------------------------------
    # (ufuncs into a scratch array and count_nonzero: a NumPy call costs ~0.3-1 µs, ndarray.any ~1.5)
    def rows_to_allocate(self, n: int) -> list[int]:
        """Rows (ascending) whose next token needs ``allocate_slots``: computed + 1 > free_end."""
        need = np.greater_equal(self.computed[:n], self.free_end[:n], out=self._flag[:n])
        return np.flatnonzero(need).tolist() if np.count_nonzero(need) else []

    def advance(self, n: int, tokens: np.ndarray) -> list[int]:
        """Rows 0..n-1 each computed one token and sampled ``tokens`` [n] int64: their computed counts
        grow by one. Returns the rows (ascending) whose token may stop them: a stop id of some row,
        the length cap reached, or a row always checked (``check_from``)."""
        computed = self.computed[:n]
        np.add(computed, 1, out=computed)
        flag = np.greater_equal(computed, self.check_from[:n], out=self._flag[:n])
        flag |= self.stop_lut.take(tokens, mode="clip")
        return np.flatnonzero(flag).tolist() if np.count_nonzero(flag) else []
