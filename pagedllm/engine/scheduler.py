"""Continuous-batching scheduler (FCFS or priority, chunked prefill, preemption by recompute).

Each ``schedule()`` call plans one engine step: every running request gets its next tokens
(one decode token, or the next chunk of its prompt), then waiting requests are admitted while
the token budget (``max_num_batched_tokens``), ``max_num_seqs`` and free KV blocks allow.
When a running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed later (prefill of prompt + generated tokens). Design after vLLM v1's unified
scheduler, where "prefill" and "decode" are just a number of new tokens per request.

The priority policy (``--scheduling-policy priority``, vLLM's) keeps both queues ordered by
(priority, arrival time), lower first: the most urgent waiting request is admitted first, running
requests get their tokens in that order, and the least urgent running request is the one
preempted (it waits again in its place in that order). FCFS is that order with every priority 0,
except that a preempted request goes back to the front.

Pipeline parallelism (``pipeline_depth`` P > 1): up to P batches are in flight, and ``schedule()``
may run again before an earlier batch's output is back. A request in a batch in flight
(``inflight``) is not scheduled again until ``update_from_output`` has that batch (its next
input token is unknown), is never chosen for preemption, and an abort of it is deferred until
then (its blocks are in use by the stages; they are freed when the output returns). Each batch
takes at most ceil(unfinished sequences / P) sequences, so the P batches are about equal (as
vLLM V0's one scheduler per virtual engine; otherwise one batch would take every request and
leave the other stages idle). Blocks are allocated at schedule time as without pipelining; a
prefix-cache hit on blocks a batch in flight is still computing is correct because every stage
runs the batches in order.

The request table (``engine/request_table.py``): when at least ``TABLE_MIN_ROWS`` requests run and every
one is a plain decode (one token to compute), the running part of ``schedule`` and the update of those
rows in ``update_from_output`` are array operations over per-row mirrors of their bookkeeping; only rows
that need a block (``KVCacheManager.allocate_decode_slots``) or whose token may stop them go through
per-request Python. The decisions are the general loop's (``tests/test_host_fast_paths.py`` compares
both after every step); not pipelined, not with speculative decoding.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.request_table import RequestTable


# stop_reason of a request aborted because its grammar could not follow the output (finish_reason "abort")
GRAMMAR_FAILED = "structured output: the grammar could not be followed (see the server log)"

# Running requests from which the request table drives a step (measured: at 8 its few NumPy calls cost
# about what the per-request loops they replace do).
TABLE_MIN_ROWS = 8


@dataclass
class SchedulerOutput:
    """One step's plan: ``scheduled`` lists (request, number of new tokens) in batch order.

    ``table_rows``: when the request table drove the step's running part, its rows (the first
    ``len(table_rows)`` entries of ``scheduled``, one token each; the table's own list, unchanged from
    step to step while they stay: do not modify it); ``update_from_output`` then advances them as arrays.
    """

    scheduled: list[tuple[Request, int]]
    preempted: list[Request] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    table_rows: Optional[list[Request]] = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Images a step needed and, of those, the ones whose encoder output was cached (LLMEngine.get_stats)
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, pipeline_depth: int = 1) -> None:
        self.config = config
        self.pipeline_depth = pipeline_depth
        self.inflight: set[str] = set()  # ids of requests in a batch whose output is not back
        self._deferred: dict[str, RequestStatus] = {}  # in-flight requests to finish when it is
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Leader request id -> sibling samples waiting for the leader's prefill to fork from it.
        self.forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self.priority = config.policy == "priority"
        # The running decode batch's bookkeeping in arrays (engine/request_table.py): used when at least
        # ``table_min_rows`` requests run (below that, a NumPy call costs more than the Python it saves),
        # not pipelined, and ``use_table`` (the engine turns it off under speculative decoding).
        self.table = RequestTable(config.max_num_seqs)
        self.use_table = True
        self.table_min_rows = TABLE_MIN_ROWS
        # The requests the last update_from_output finished, in the order of the list it returned.
        self.last_finished: list[Request] = []

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request, forks: Iterable[Request] = ()) -> None:
        """Queue ``request``; ``forks`` (the other samples of an ``n`` > 1 request) join it once its
        prompt is prefilled, sharing its blocks (one prefill for all samples)."""
        self._enqueue(self.waiting, request)
        self.requests[request.request_id] = request
        forks = list(forks)
        self._set_stop_filter(request)
        if forks:
            self.forks[request.request_id] = forks
            for f in forks:
                self.requests[f.request_id] = f
                self._set_stop_filter(f)

    def _set_stop_filter(self, req: Request) -> None:
        """What update_from_output tests every sampled token against before it calls ``_check_stop``:
        ``stop_ids``, every token id that can stop the request (whatever min_tokens says), and
        ``length_cap``, the token count at which it is capped (max_tokens outputs or max_model_len)."""
        sp = req.sampling_params
        ids = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            ids |= set(sp.all_stop_token_ids or ())
            if req.eos_token_id is not None:
                ids.add(req.eos_token_id)
        req.stop_ids = frozenset(ids)
        req.length_cap = min(req.num_prompt_tokens + req.max_tokens, self.config.max_model_len)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.forks)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + sum(len(f) for f in self.forks.values())

    def num_running_seqs(self) -> int:
        """Sequences that hold (or will hold once their leader's prefill ends) a running slot:
        the running ones plus the not-yet-forked siblings of running leaders."""
        if not self.forks:
            return len(self.running)
        return len(self.running) + sum(len(self.forks[r.request_id]) for r in self.running
                                       if r.request_id in self.forks)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string) and free their blocks now; unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if rid in self.inflight:  # finished now; the stages still use its blocks until the batch returns
                self._deferred[rid] = req.status = status
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:  # a sibling still waiting to fork
                siblings = self.forks.get(req.parent_leader_id, [])
                if req in siblings:
                    siblings.remove(req)
                if not siblings:
                    self.forks.pop(req.parent_leader_id, None)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.metrics.finished_time = time.time()
        self.kv.free(req)
        del self.requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.priority:
            self._enqueue(self.waiting, req)
        else:
            self.waiting.appendleft(req)

    def _enqueue(self, queue, req: Request) -> None:
        """Append ``req`` (FCFS), or insert it in (priority, arrival) order after its equals."""
        if self.priority:
            bisect.insort_right(queue, req, key=lambda r: r.priority_key)
        else:
            queue.append(req)

    def _pop_victim(self, first: int) -> Request:
        """The newest running request at index >= ``first`` that is not in flight (index
        ``first`` itself is the one being scheduled, never in flight)."""
        for j in range(len(self.running) - 1, first - 1, -1):
            if self.running[j].request_id not in self.inflight:
                return self.running.pop(j)
        raise AssertionError("the request being scheduled is in flight")

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        pipelined = self.pipeline_depth > 1
        if pipelined:  # a fair share of the sequences, so that every stage has a batch
            seq_cap = -(-(self.num_running_seqs() + len(self.waiting)) // self.pipeline_depth)
            batch_seqs = 0

        # 1. Running requests, oldest first; preempt from the newest end when out of blocks.
        running = self.running  # (preemption pops from this same list)
        allocate_slots = self.kv.allocate_slots
        i = 0
        table_rows = None
        if (self.use_table and not pipelined and self.table_min_rows <= len(running) <= budget):
            i = self._schedule_table_rows()
            if i == len(running):  # every running request a decode the table drove
                table_rows = self.table.rows
                scheduled = self.table.scheduled()
                budget -= i
            elif i > 0:  # out of blocks at row i: the general loop goes on from there (it preempts)
                scheduled = self.table.scheduled()[:i]
                budget -= i
            else:
                i = 0
        if table_rows is None:
            self.table.invalidate()  # (the general loop below changes what the rows mirror)
        while i < len(running) and budget > 0:
            req = running[i]
            if pipelined:
                if batch_seqs >= seq_cap:
                    break
                if req.request_id in self.inflight:
                    i += 1
                    continue
                batch_seqs += 1 + len(self.forks.get(req.request_id, ()))
            num_new = len(req.all_token_ids) - req.num_computed_tokens + len(req.spec_token_ids)  # (+ proposals)
            if num_new > budget:
                num_new = budget
            if req.mm_features and req.num_computed_tokens < req.num_prompt_tokens:
                num_new = req.mm_chunk_tokens(req.num_computed_tokens, num_new)  # images whole
                if num_new == 0:  # its next image does not fit this step's budget
                    i += 1
                    continue
            if req.num_computed_tokens + num_new <= req.kv_free_end:  # (most decodes: nothing to allocate)
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            ok = True
            while not allocate_slots(req, num_new):
                victim = self._pop_victim(i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        # 2. Admit waiting requests (not in a step that had to preempt: memory is short).
        # max_num_seqs counts sequences, so a running leader's siblings waiting to fork count too.
        if table_rows is not None and self.waiting:
            scheduled = list(scheduled)  # (the table's list is kept: admissions go on a copy)
        num_seqs = self.num_running_seqs() if self.waiting else 0
        loras: Optional[set[int]] = None  # adapters of the running requests, once one is needed
        while not preempted and self.waiting and budget > 0 and num_seqs < self.config.max_num_seqs:
            req = self.waiting[0]
            width = 1 + len(self.forks.get(req.request_id, ()))
            if self.running and num_seqs + width > self.config.max_num_seqs:
                break
            if pipelined and batch_seqs >= seq_cap:
                break
            if self.config.max_loras and req.lora_request is not None:  # at most max_loras adapters a step
                if loras is None:
                    loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                if req.lora_request.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                    break
                loras.add(req.lora_request.lora_int_id)
            if req.sampling_params.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
                cached_blocks, num_cached = [], 0  # cached positions would have no logits to report
            else:
                cached_blocks, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if req.mm_features:
                num_new = req.mm_chunk_tokens(num_cached, num_new)  # images whole
                if num_new == 0:  # its first image does not fit this step's budget
                    break
            if not self.kv.allocate_slots(req, num_new, cached_blocks):
                break
            self.waiting.popleft()
            self.kv.prefix_cache_queries += req.num_tokens
            self.kv.prefix_cache_hits += num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self._enqueue(self.running, req)
            num_seqs += width
            scheduled.append((req, num_new))
            budget -= num_new
            if pipelined:
                batch_seqs += width

        if pipelined:
            self.inflight.update(r.request_id for r, _ in scheduled)
        return SchedulerOutput(scheduled=scheduled, preempted=preempted,
                               total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
                               table_rows=table_rows)

    def _schedule_table_rows(self) -> int:
        """The running part of a step through the request table: every running request must be a plain
        decode (one token, see ``engine/request_table.py``); only the rows whose token needs a block call
        ``allocate_slots``. Returns how many leading running requests were scheduled one token each:
        all of them, or the row whose allocation failed (the general loop goes on there and preempts;
        a failed allocate_slots changes nothing), or 0 when a request is not a plain decode."""
        running = self.running
        table = self.table
        table.sync(running)
        n = len(running)
        if np.count_nonzero(table.known[:n]) < n:
            forks = self.forks
            rows = np.flatnonzero(~table.known[:n]).tolist()
            reqs = [running[i] for i in rows]
            for r in reqs:  # (past its prompt: it sampled before, no prompt logprobs, images or forks left)
                computed = r.num_computed_tokens
                if not (computed + 1 == len(r.all_token_ids) and computed >= r.num_prompt_tokens
                        and not r.spec_token_ids and r.status is RequestStatus.RUNNING
                        and r.metrics.first_token_time is not None and r.request_id not in forks):
                    return 0
            table.refresh(rows, reqs)
        need = table.rows_to_allocate(n)
        if need:
            reqs = [running[i] for i in need]
            done = self.kv.allocate_decode_slots(reqs)
            table.free_end[need[:done]] = [r.kv_free_end for r in reqs[:done]]
            if done < len(need):
                return need[done]
        return n

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           tokens: Optional[Sequence[int]] = None,
                           token_array: Optional[np.ndarray] = None) -> list[Request]:
        """Advance computed-token counts, append sampled tokens, finish requests that hit EOS, a
        stop token id, ``max_tokens`` or ``max_model_len`` (freeing their blocks now).

        ``sampled``: request id -> its sampled token. ``tokens``: optional, the step's sampled tokens in
        sampling order, whose first ``len(out.table_rows)`` are the table rows' (one each, in order:
        what the input batch gives them); those rows are then advanced as arrays and need no entry in
        ``sampled``. ``token_array``: optional, ``tokens`` as an int64 array (made once by the caller).

        Returns the requests that received a new token this step (under the pooling runner, with no
        ``sampled`` token: those whose prompt is done, now finished); ``last_finished`` holds those
        of them that finished.
        """
        updated = []
        self.last_finished = finished = []
        forks = self.forks
        inflight = self.inflight
        check_stop = self._check_stop
        now = time.time()  # one timestamp for the step's tokens (they come from one forward)
        scheduled = out.scheduled
        rows = out.table_rows
        if rows is not None:
            if tokens is not None and rows is self.table.rows:
                self._update_table_rows(rows, tokens, token_array, now, updated)
                scheduled = scheduled[len(rows):]
            else:
                self.table.invalidate()
        for req, n in scheduled:
            if inflight:
                self.inflight.discard(req.request_id)
                status = self._deferred.pop(req.request_id, None)
                if status is not None:  # aborted while in flight: its blocks are free to go now
                    self.running.remove(req)
                    for sibling in self.forks.pop(req.request_id, ()):
                        self._finish(sibling, status)
                    self._finish(req, status)
                    continue
            if req.status.finished:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < len(req.all_token_ids):
                continue  # a prefill chunk that does not reach the end: nothing sampled
            new_reqs: Sequence[Request] = (req,)  # the common case: one sequence
            if forks and req.request_id in forks:  # n > 1: the samples fork from it now its prompt is done
                new_reqs = [req]
                for sibling in forks.pop(req.request_id):
                    self.kv.fork(req, sibling)
                    sibling.num_computed_tokens = req.num_computed_tokens
                    sibling.status = RequestStatus.RUNNING
                    sibling.metrics.first_scheduled_time = req.metrics.first_scheduled_time
                    sibling.num_cached_tokens = req.num_cached_tokens
                    self._enqueue(self.running, sibling)
                    new_reqs.append(sibling)
            for r in new_reqs:
                token = sampled.get(r.request_id)
                metrics = r.metrics
                if token is None:  # the pooling runner: done once the prompt is, with no token
                    metrics.first_token_time = metrics.last_token_time = now
                    self.running.remove(r)
                    self._finish(r, RequestStatus.FINISHED_STOPPED)
                    updated.append(r)
                    finished.append(r)
                    continue
                r.output_token_ids.append(token)  # (Request.append_output_token, inlined: once a token)
                r.all_token_ids.append(token)
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                # _check_stop only where it can answer something (a stop id, the length cap, a grammar)
                if token in r.stop_ids or len(r.all_token_ids) >= r.length_cap or r.grammar is not None:
                    status = check_stop(r, token)
                    if status is not None:
                        self.running.remove(r)
                        self._finish(r, status)
                        finished.append(r)
                updated.append(r)
        return updated

    def _update_table_rows(self, rows: list[Request], tokens: Sequence[int], token_array: Optional[np.ndarray],
                           now: float, updated: list[Request]) -> None:
        """update_from_output for the table rows (plain decodes, row i sampled ``tokens[i]``): the same
        changes as its general loop, the stop filter as array operations (``RequestTable.advance``) and
        ``_check_stop`` only for the rows it flags, in row order (so blocks are freed in the same order)."""
        n = len(rows)
        toks = tokens if len(tokens) == n else tokens[:n]
        arr = token_array[:n] if token_array is not None else np.fromiter(toks, np.int64, n)
        flagged = self.table.advance(n, arr)
        for r, tok in zip(rows, toks):  # (what the general loop does to a plain decode, nothing else)
            r.num_computed_tokens += 1
            r.output_token_ids.append(tok)
            r.all_token_ids.append(tok)
            r.metrics.last_token_time = now
        updated.extend(rows)
        finished = self.last_finished
        for i in flagged:
            r = rows[i]
            status = self._check_stop(r, toks[i])
            if status is not None:
                self._finish(r, status)
                finished.append(r)
        if finished:  # out of the running list at once (one remove a request is O(running) each)
            if len(finished) <= 2:
                for r in finished:
                    self.running.remove(r)
            else:
                gone = set(finished)
                self.running[:] = [r for r in self.running if r not in gone]

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.grammar is not None and req.grammar.failed:  # its output can no longer be constrained
            req.stop_reason = GRAMMAR_FAILED
            return RequestStatus.FINISHED_ABORTED
        num_out = len(req.output_token_ids)
        if num_out >= sp.min_tokens:
            if token == req.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in sp.all_stop_token_ids and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
        if num_out >= req.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
        )
