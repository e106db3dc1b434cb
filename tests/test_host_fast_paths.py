"""The persistent input batch and the KV manager's one allocation path (issue 37) give what the
original code gave: ``allocate_slots`` against the original general path (kept here as the oracle) on
random workloads (prefix hits, n > 1 forks with copy-on-write, preemption), and every step's batch of
the persistent ``InputBatch`` against the original list-built batch, both driven by a scheduler with
random token streams (requests joining and leaving at every position, moving under the priority
policy, preemption and resume, forks, prefix hits, chunked prefill, prompt logprobs; the pool empty
afterwards) and inside a real engine run, whose outputs equal transformers' greedy tokens."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
import transformers

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.config import SchedulerConfig
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.input_batch import InputBatch
from pagedllm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine import scheduler as scheduler_module
from pagedllm.engine.scheduler import Scheduler
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.structured_output.params import StructuredOutputsParams
from test_correctness import make_prompts, reference


def assert_meta_equal(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    assert (a.num_decode_tokens, a.prefills, a.block_size, a.max_decode_seq_len) == \
        (b.num_decode_tokens, b.prefills, b.block_size, b.max_decode_seq_len)


# ---- allocate_slots against the original general path ------------------------------------------
class GeneralOnly(KVCacheManager):
    """allocate_slots as pagedllm wrote it before its one path (every call through this body)."""

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=None):
        new_computed_blocks = new_computed_blocks or []
        self._block_ids.pop(request.request_id, None)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        if self.sliding_window is not None:
            new_computed_blocks = self._drop_behind_window(blocks, new_computed_blocks, num_computed)[0]
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        write_idx = num_computed // self.block_size
        cow = (num_new_tokens > 0 and num_computed % self.block_size != 0 and not new_computed_blocks
               and write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1)
        if num_new_blocks + num_evictable_hits + cow > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        if cow:
            shared = blocks[write_idx]
            blocks[write_idx] = self.block_pool.get_new_blocks(1)[0]
            self.pending_copies.append((shared.block_id, blocks[write_idx].block_id))
            self.block_pool.free_blocks([shared])
        self.block_pool.touch(b for b in new_computed_blocks if b is not self.null_block)
        blocks.extend(new_computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True


def kv_state(kv: KVCacheManager, rids) -> tuple:
    pool = kv.block_pool
    for rid in rids:  # the kept block-id lists are those of the blocks
        assert kv.get_block_ids(rid) == [b.block_id for b in kv.req_to_blocks.get(rid, ())], rid
    return ({rid: kv.get_block_ids(rid) for rid in rids},
            {rid: [b.block_id for b in kv.req_to_blocks.get(rid, ())] for rid in rids},
            {rid: kv.num_cached_blocks.get(rid, 0) for rid in rids},
            [b.ref_cnt for b in pool.blocks], list(pool.free_block_queue),
            sorted((h, b.block_id) for h, b in pool.cached_block_hash_to_block.items()),
            pool.num_cached_free_blocks, list(kv.pending_copies))


@pytest.mark.parametrize("seed", range(8))
def test_allocate_slots_matches_the_original_path(seed):
    """The same random workload (admissions with prefix hits, prefill chunks, decodes that fill
    blocks, forks that copy on write, preemptions, finishes; a sliding window for some seeds) on two
    managers, one with the original allocation code: every answer and the whole pool state equal
    after every operation."""
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    window = 2 * bs + 3 if seed % 4 == 3 else None
    kvs = [KVCacheManager(48, bs, sliding_window=window), GeneralOnly(48, bs, sliding_window=window)]
    reqs: list[dict[str, Request]] = [{}, {}]
    running: list[str] = []
    shared = [rng.randrange(100) for _ in range(3 * bs + 2)]
    sp = SamplingParams(max_tokens=1000)
    for step in range(300):
        op = rng.random()
        if op < 0.2 or not running:  # admit a new request, maybe with a cached prefix
            rid = f"r{step}"
            prompt = (shared[:rng.randrange(1, len(shared))] if rng.random() < 0.5 else []) + \
                [rng.randrange(100) for _ in range(rng.randrange(1, 3 * bs))]
            results = []
            for kv, rs in zip(kvs, reqs):
                r = rs[rid] = Request(rid, prompt, sp, None)
                hits, n = kv.get_computed_blocks(r)
                ok = kv.allocate_slots(r, r.num_tokens - n, hits)
                if ok:
                    r.num_computed_tokens = n + (r.num_tokens - n)
                results.append((ok, n))
            assert results[0] == results[1]
            if results[0][0]:
                running.append(rid)
            else:
                for kv, rs in zip(kvs, reqs):
                    del rs[rid]
        elif op < 0.3 and len(running) < 12:  # fork a running request (n > 1)
            parent = rng.choice(running)
            child = f"{parent}+{step}"
            for kv, rs in zip(kvs, reqs):
                p = rs[parent]
                c = rs[child] = Request(child, p.prompt_token_ids, sp, None)
                c.all_token_ids = list(p.all_token_ids)
                c.output_token_ids = list(p.output_token_ids)
                c.num_computed_tokens = p.num_computed_tokens
                kv.fork(p, c)
            running.append(child)
        elif op < 0.38:  # finish or preempt one
            rid = running.pop(rng.randrange(len(running)))
            preempt = rng.random() < 0.5
            for kv, rs in zip(kvs, reqs):
                kv.free(rs[rid])
                if preempt:  # recompute later as a new admission of the same tokens
                    rs[rid].num_computed_tokens = 0
            if preempt:
                results = []
                for kv, rs in zip(kvs, reqs):
                    r = rs[rid]
                    hits, n = kv.get_computed_blocks(r)
                    ok = kv.allocate_slots(r, r.num_tokens - n, hits)
                    if ok:
                        r.num_computed_tokens = r.num_tokens
                    results.append((ok, n))
                assert results[0] == results[1]
                if results[0][0]:
                    running.append(rid)
        else:  # a decode step of one running request: one new token
            rid = rng.choice(running)
            tok = rng.randrange(100)
            results = []
            for kv, rs in zip(kvs, reqs):
                r = rs[rid]
                r.append_output_token(tok)
                results.append(kv.allocate_slots(r, 1))
                if results[-1]:
                    r.num_computed_tokens += 1
                else:
                    r.all_token_ids.pop()
                    r.output_token_ids.pop()
            assert results[0] == results[1]
        assert kv_state(kvs[0], reqs[0]) == kv_state(kvs[1], reqs[1]), step
        assert kvs[0].take_pending_copies() == kvs[1].take_pending_copies()


def test_decode_inside_a_block_allocates_nothing():
    kv = KVCacheManager(8, 4)
    r = Request("a", [1, 2, 3], SamplingParams(), None)
    assert kv.allocate_slots(r, 3)
    assert kv.take_table_changes() == {r: 0} and kv.take_table_changes() == {}
    r.num_computed_tokens = 3
    table = kv.get_block_ids("a")
    r.append_output_token(9)
    assert kv.allocate_slots(r, 1) and kv.get_block_ids("a") is table  # the same list: nothing changed
    assert kv.take_table_changes() == {}
    r.num_computed_tokens = 4
    assert kv.block_pool.get_cached_block(r.block_hashes[0]) is not None  # the block filled
    r.append_output_token(9)
    assert kv.allocate_slots(r, 1) and kv.get_block_ids("a") == table + [kv.req_to_blocks["a"][1].block_id]
    assert kv.take_table_changes() == {r: 1}  # one block appended: only entry 1 to write
    assert kv.get_block_ids("a") is not table  # a new block: a new list (the old one left as it was)
    assert len(table) == 1


# ---- a real engine: every step's batch against the original list-built batch ---------------------
def reference_prepare_inputs(out, kv, device, forks=None):
    """The input batch as pagedllm built it before issue 37's fast paths (block tables read from
    the blocks themselves, every sequence through one loop, AttentionMetadata.build)."""
    bs = kv.block_size
    decodes = [(r, n) for r, n in out.scheduled if n == 1]
    prefills = [(r, n) for r, n in out.scheduled if n > 1]
    input_ids, positions, slot_mapping, sample_idx, sampling_requests, plp_idx, plp_spans = [], [], [], [], [], [], []
    tables, seq_lens, query_lens = [], [], []
    for r, n in decodes + prefills:
        start = r.num_computed_tokens
        offset = len(input_ids)
        table = [b.block_id for b in kv.req_to_blocks.get(r.request_id, ())]
        if start + n == r.num_tokens:
            for s in [r, *(forks or {}).get(r.request_id, ())]:
                sample_idx.append(offset + n - 1)
                sampling_requests.append(s)
        if r.sampling_params.prompt_logprobs is not None:
            first = max(start, len(r.prompt_logprobs) - 1)
            last = min(start + n, r.num_prompt_tokens - 1)
            if last > first:
                plp_idx.extend(range(offset + first - start, offset + last - start))
                plp_spans.append((r, first + 1, last - first))
        input_ids.extend(r.all_token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        tables.append(table)
        seq_lens.append(start + n)
        query_lens.append(n)
    meta = AttentionMetadata.build(torch.tensor(slot_mapping, dtype=torch.long), tables, seq_lens, query_lens, bs,
                                   device)
    return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta,
            torch.tensor(sample_idx + plp_idx, dtype=torch.long), sampling_requests, plp_spans)


def assert_plan_equal(plan, ref) -> None:
    ids, pos, meta, logits_idx, sreqs, spans = ref
    mi = plan.model_input
    assert torch.equal(mi.input_ids, ids) and mi.input_ids.dtype == torch.long
    assert torch.equal(mi.positions, pos) and mi.positions.dtype == torch.long
    assert torch.equal(mi.logits_indices, logits_idx) and mi.logits_indices.dtype == torch.long
    assert_meta_equal(mi.attn_metadata, meta)
    assert plan.sampling_requests == sreqs and plan.prompt_logprob_spans == spans


class AlwaysAsked(KVCacheManager):
    """allocate_slots never promises free tokens (Request.kv_free_end stays 0): the scheduler calls it
    for every running request, as before the skip."""

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=None):
        ok = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        request.kv_free_end = 0
        return ok


@pytest.mark.parametrize("seed", range(12))
def test_persistent_batch_and_skipped_allocations_and_request_table(seed):
    """A scheduler, a KV manager and the persistent batch without a model, on random workloads
    (drive_random_scheduler: rows joining and leaving at every position, forks, copy-on-write, prefix
    hits, preemption and resume, chunked prefill, stop token ids, aborts, sliding windows, caching on
    and off), run three ways: as the engine runs (allocate_slots skipped where Request.kv_free_end says
    it has nothing to do), with every allocate_slots call made (AlwaysAsked), and with the scheduler's
    request table (engine/request_table.py) driving every step it can, from one running request on.

    - Every step's batch equals the original list-built one (inside each run), and the pool is empty
      at the end.
    - The three runs give the same schedule, block tables, reference counts, free queue, cached hashes,
      copies and each request's tokens, computed count and status after every step (and the same
      kv_free_end, with and without the table); the skip is taken and the table drove steps."""
    a, b, c = [], [], []
    skipping = drive_random_scheduler(seed, KVCacheManager, a, table=False)
    every = drive_random_scheduler(seed, AlwaysAsked, b, table=False)
    tabled = drive_random_scheduler(seed, KVCacheManager, c, table=True)
    assert len(a) == len(b) == len(c)
    for step, (x, y, z) in enumerate(zip(a, b, c)):
        assert x == z, step
        assert x[:4] == y[:4] and [st[:-1] for st in x[4]] == [st[:-1] for st in y[4]], step  # (not kv_free_end)
    if seed % 4 != 3 and skipping.bs >= 4:  # (under a sliding window none is skipped; nor, with caching, at 1-2 a block)
        assert skipping.calls < every.calls
    else:
        assert skipping.calls <= every.calls
    assert tabled.table_steps > 10 and tabled.table_allocations > 0


class DriveStats:
    """What drive_random_scheduler saw: allocate_slots calls (counted with a trace only), the block
    size, steps whose running part the request table drove, and blocks it allocated in them."""

    def __init__(self) -> None:
        self.calls = self.bs = self.table_steps = self.table_allocations = 0


def drive_random_scheduler(seed: int, kv_cls, trace: list | None = None, table: bool = False) -> DriveStats:
    """Random token streams stand in for the sampler. Requests (some sharing prefixes: prefix hits; some
    n > 1: forks with copy-on-write; some with prompt logprobs, some with stop token ids and min_tokens;
    priorities under the priority policy, so rows move) join over the run and stop at random lengths, so
    sequences join and leave at every row; a small pool forces preemption and resume; a small token
    budget chunks prefills (one-token chunks included); some are aborted. Every step's batch is checked
    against the original list-built one, and every kept row against its block table; the pool must be
    empty at the end. With ``trace``, each step's (scheduled (id, tokens), preempted, KV state, table
    changes, requests' (id, computed, tokens, status, kv_free_end)) is appended to it. ``table``: the
    scheduler's request table off (False) or on from one running request (True). Returns a DriveStats."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    priority = seed % 3 == 2
    kv = kv_cls(rng.choice([12, 24, 64]) * (16 // bs if bs < 16 else 1), bs,
                enable_caching=seed % 4 != 1, sliding_window=3 * bs + 1 if seed % 4 == 3 else None)
    stats = DriveStats()
    stats.bs = bs
    if trace is not None:
        real = kv.allocate_slots

        def counted(*a, **kw):
            stats.calls += 1
            return real(*a, **kw)
        kv.allocate_slots = counted
        real_decodes = kv.allocate_decode_slots

        def counted_decodes(reqs):  # (its general cases call allocate_slots, counted there)
            done = real_decodes(reqs)
            stats.calls += done
            stats.table_allocations += done
            return done
        kv.allocate_decode_slots = counted_decodes
    max_len = 96
    cfg = SchedulerConfig(max_num_batched_tokens=rng.choice([17, 33, 64]), max_num_seqs=rng.choice([3, 8, 32]),
                          max_model_len=max_len, policy="priority" if priority else "fcfs")
    sched = Scheduler(cfg, kv)
    sched.use_table, sched.table_min_rows = table, 1
    batch = InputBatch(kv, 2, 8, "cpu")  # (small: its rows and table width grow)
    shared = [rng.randrange(100) for _ in range(40)]
    pending = 40
    steady_steps = 0
    for step in range(2000):
        if pending and rng.random() < 0.3:
            pending -= 1
            prompt = (shared[:rng.randrange(1, 40)] if rng.random() < 0.5 else []) + \
                [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
            n = 2 if rng.random() < 0.2 else 1
            stops = rng.sample(range(100), 3) if rng.random() < 0.25 else None  # (tokens are 0-99)
            max_tokens = rng.randrange(1, 40)
            sp = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, stop_token_ids=stops,
                                min_tokens=min(rng.randrange(4), max_tokens) if stops else 0,
                                prompt_logprobs=1 if rng.random() < 0.1 else None)
            rid = f"r{step}"
            kids = [Request(rid if n == 1 else f"{rid}#{i}", prompt, sp, None, max_tokens=sp.max_tokens,
                            parent_id=rid, index=i, priority=rng.randrange(3) if priority else 0)
                    for i in range(n)]
            sched.add_request(kids[0], forks=kids[1:])
        if not sched.has_unfinished_requests():
            if not pending:
                break
            continue
        out = sched.schedule()
        stats.table_steps += out.table_rows is not None
        if trace is not None:
            trace.append(([(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted],
                          kv_state(kv, list(sched.requests)), {r.request_id: f for r, f in kv.table_changes.items()},
                          [(r.request_id, r.num_computed_tokens, r.all_token_ids, r.status, r.kv_free_end)
                           for r in sched.requests.values()]))
        if out.is_empty:
            continue
        steady_steps += bool(batch.rows) and bool(batch.steady[:len(batch.rows)].all())
        plan = batch.prepare(out, sched.forks)
        assert_plan_equal(plan, reference_prepare_inputs(out, kv, "cpu", sched.forks))
        for i, r in enumerate(batch.rows):  # every kept row is its table, zero past it (not only the used width)
            ids = kv.get_block_ids(r.request_id)
            assert batch.num_blocks[i] == len(ids) and batch.tables[i, :len(ids)].tolist() == ids, step
            assert not batch.tables[i, len(ids):].any(), step
        sampled = {r.request_id: rng.randrange(100) for r in plan.sampling_requests}
        tokens = [sampled[r.request_id] for r in plan.sampling_requests]
        batch.record_sampled(plan, tokens)
        for r, n_pos in [(r, n) for r, _, n in plan.prompt_logprob_spans]:
            r.prompt_logprobs.extend([None] * n_pos)  # (what the engine appends: one entry a position)
        if step % 2:  # (the engine's call: tokens in sampling order, as a list and an array)
            updated = sched.update_from_output(out, sampled, tokens, np.array(tokens, np.int64))
        else:
            updated = sched.update_from_output(out, sampled, tokens)
        assert sched.last_finished == [r for r in updated if r.is_finished]
        if rng.random() < 0.03 and sched.running:  # an abort (or a stop string) in the middle of the batch
            sched.finish_requests([rng.choice(sched.running).request_id], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and not pending
    assert steady_steps > 10  # steps whose decode rows all advanced in place
    assert kv.req_to_blocks == {}
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks if b is not pool.null_block)
    return stats


def test_every_step_batch_matches_the_list_built_batch(llama_dir, monkeypatch):
    """Requests arrive over the run and stop after 1 to 30 tokens (so they join and leave at every
    position of the batch), the cache holds 17 blocks (preemption and resume), with prefix hits
    (prompts sharing a 64-token prefix), n = 2 forks (greedy: both samples equal transformers;
    seeded: run twice, equal), prompt logprobs and chunked prefill. Every step's batch equals
    reference_prepare_inputs', and the greedy outputs transformers' tokens. The first run has the
    scheduler's request table drive every step it can (from one running request), the second none:
    every output (tokens, text, finish reason) is the same."""
    prompts = make_prompts(256, [1, 2, 5, 17, 40, 96, 150, 231], seed=5)
    prompts += [prompts[6][:64] + p for p in make_prompts(256, [3, 20, 70], seed=6)]
    ref = reference(llama_dir, prompts, n=30)
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # as test_correctness: 17 blocks of 16 tokens
    checked = {"steps": 0, "decode_only": 0, "table": 0}
    real = InputBatch.prepare

    def checking(self, out, forks=None):
        plan = real(self, out, forks)
        assert_plan_equal(plan, reference_prepare_inputs(out, self.kv, self.device, forks))
        checked["steps"] += 1
        checked["decode_only"] += not plan.model_input.attn_metadata.prefills
        return plan

    monkeypatch.setattr(InputBatch, "prepare", checking)

    def run(table_min_rows):
        monkeypatch.setattr(scheduler_module, "TABLE_MIN_ROWS", table_min_rows)
        llm = LLM(llama_dir, kv_cache_memory=17 * bytes_per_block, max_model_len=272, max_num_batched_tokens=64,
                  max_num_seqs=6)
        engine = llm.llm_engine
        real_schedule = engine.scheduler.schedule

        def counting():
            out = real_schedule()
            checked["table"] += out.table_rows is not None
            return out
        engine.scheduler.schedule = counting
        order = list(range(len(prompts)))
        random.Random(1).shuffle(order)
        finals = {}
        step = 0
        while order or engine.has_unfinished_requests():
            for _ in range(step % 3):  # 0, 1 or 2 arrivals a step
                if order:
                    i = order.pop()
                    n_tok = 1 + (7 * i) % 30
                    kw = dict(prompt_logprobs=1) if i == 3 else {}
                    engine.add_request(f"g{i}", {"prompt_token_ids": prompts[i]},
                                       SamplingParams(temperature=0.0, max_tokens=n_tok, ignore_eos=True,
                                                      n=2 if i % 4 == 1 else 1, **kw))
                    if i % 3 == 0:
                        engine.add_request(f"s{i}", {"prompt_token_ids": prompts[i]},
                                           SamplingParams(temperature=1.0, seed=i, max_tokens=n_tok, n=2,
                                                          ignore_eos=True))
            for o in engine.step():
                if o.finished:
                    finals[o.request_id] = o
            step += 1
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv_cache_manager.prefix_cache_hits > 0
        assert_pool_empty(llm)
        return finals

    finals = run(1)
    assert checked["table"] > 10
    for i, p in enumerate(prompts):
        n_tok = 1 + (7 * i) % 30
        outs = finals[f"g{i}"].outputs
        assert len(outs) == (2 if i % 4 == 1 else 1)
        for c in outs:
            assert c.token_ids == ref[i][0][:n_tok] and c.finish_reason == "length"
    checked["table"] = 0
    again = run(10**9)
    assert checked["table"] == 0
    for rid, o in finals.items():
        assert [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in again[rid].outputs]
    assert checked["decode_only"] > 10 and checked["steps"] > checked["decode_only"]


def test_status_attributes():
    assert [s.finished for s in RequestStatus] == [False, False, False, True, True, True]
    assert [s.finish_reason for s in RequestStatus] == [None, None, None, "stop", "length", "abort"]
    r = Request("a", [1], SamplingParams(), None)
    assert not r.is_finished
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.is_finished and r.status.finish_reason == "abort"


def test_sampling_params_clone_equals_deepcopy():
    """SamplingParams.clone (field by field, once per sample) gives deepcopy's value and shares nothing
    mutable with the original."""
    for sp in (SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
               SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4], logit_bias={1: 2.0}, allowed_token_ids=[1, 2],
                              bad_words=["x"], seed=3, logprobs=2, structured_outputs=StructuredOutputsParams(regex="a+"))):
        sp.all_stop_token_ids, sp.bad_words_token_ids = {1, 2}, [[1, 2], [3]]
        a = sp.clone()
        assert type(a) is SamplingParams and vars(a) == vars(copy.deepcopy(sp))
        for name, value in vars(a).items():
            assert isinstance(value, (int, float, str, type(None))) or value is not getattr(sp, name)
        a.bad_words_token_ids[0].append(9)
        assert sp.bad_words_token_ids == [[1, 2], [3]]


# ---- the detokenizer's one-token texts ---------------------------------------------------------
class _NeverKept(dict):
    """A one_token_texts dict that keeps nothing: every window is decoded."""

    def __setitem__(self, key, value) -> None:
        pass


@pytest.mark.parametrize("skip_special", [True, False])
def test_shared_one_token_texts_give_the_same_text(llama_dir, skip_special):
    """Many streams (multi-byte characters split over tokens, special tokens, several tokens at
    once, stop strings) through detokenizers sharing one dict give the text of detokenizers that
    decode every window."""
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    text_ids = tok.encode("caf\u00e9 \u65e5\u672c\U0001f600 na\u00efve, the end. \u00fcber", add_special_tokens=False)
    rng = random.Random(0)
    shared: dict[int, str] = {}
    specials = [t for t in (tok.bos_token_id, tok.eos_token_id) if t is not None]
    for stream in range(40):
        ids = [rng.choice(text_ids + specials) if rng.random() < 0.7 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 8))]
        stop = ["the", "\u00e9"] if stream % 3 == 0 else []
        a = IncrementalDetokenizer(tok, prompt, skip_special, stop, False, shared)
        b = IncrementalDetokenizer(tok, prompt, skip_special, stop, False, _NeverKept())
        i = 0
        while i < len(ids):
            k = 1 if rng.random() < 0.8 else rng.randrange(2, 4)
            ra, rb = a.update(ids[i:i + k]), b.update(ids[i:i + k])
            assert ra == rb and a.output_text == b.output_text
            assert (a.prefix_offset, a.read_offset) == (b.prefix_offset, b.read_offset)
            if ra is not None:
                break
            i += k
    assert shared
