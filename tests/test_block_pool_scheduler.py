"""Block pool, KV cache manager and scheduler on their own (no model)."""
from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.engine.block_pool import BlockPool, hash_block_tokens, ROOT_HASH
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def make_req(rid: str, n_prompt: int, max_tokens: int = 4, first: int = 0, **kw) -> Request:
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_id=None, max_tokens=max_tokens)


def test_block_pool_refcounts_and_lru_order():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.get_num_free_blocks() == 1
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))
    assert pool.get_num_free_blocks() == 4
    # Uncached blocks go back to the head of the free queue: freed last-first, they come out in
    # the request's order, before the never-used block 3 (its pages stay untouched).
    order = [b.block_id for b in pool.get_new_blocks(4)]
    assert order == [a[0].block_id, a[1].block_id, a[2].block_id, 3]
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[0], pool.blocks[0]])


def test_block_pool_hands_out_uncached_blocks_before_evicting_cached_ones():
    pool = BlockPool(6)
    a = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(ROOT_HASH, [i]) for i in range(2)]
    pool.cache_block(a[0], hashes[0])
    pool.cache_block(a[1], hashes[1])
    pool.free_blocks(reversed(a))  # a[3], a[2] uncached -> head; a[1], a[0] cached -> tail (LRU)
    assert pool.num_cached_free_blocks == 2
    order = [b.block_id for b in pool.get_new_blocks(4)]
    # Uncached a[2], a[3] first, then the never-used 4 and 5; the cached blocks survive.
    assert order == [a[2].block_id, a[3].block_id, 4, 5]
    assert pool.get_cached_block(hashes[0]) is a[0] and pool.get_cached_block(hashes[1]) is a[1]
    # Under more pressure the cached blocks go, least recently freed first (a[1] before a[0]).
    assert [b.block_id for b in pool.get_new_blocks(1)] == [a[1].block_id]
    assert pool.get_cached_block(hashes[1]) is None and pool.get_cached_block(hashes[0]) is a[0]


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    pool.cache_block(b, h)
    pool.free_blocks([b])
    assert pool.get_cached_block(h) is b and pool.get_num_free_blocks() == 2
    pool.touch([b])  # a cache hit takes it back out of the free queue
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # pressure: the cached block is evicted and reused
    assert pool.get_cached_block(h) is None


def test_chained_hash_depends_on_prefix():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3])
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(hash_block_tokens(ROOT_HASH, [9, 2, 3]), [4, 5, 6])


def test_allocate_slots_block_table_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    r = make_req("a", 10)
    assert kv.allocate_slots(r, 10)
    assert len(kv.get_block_ids("a")) == 3  # ceil(10 / 4)
    r.num_computed_tokens = 10
    r.append_output_token(99)
    assert kv.allocate_slots(r, 1) and len(kv.get_block_ids("a")) == 3  # slot 11 fits block 3
    big = make_req("b", 40)
    assert not kv.allocate_slots(big, 40)  # needs 10 blocks, 7 free: nothing changes
    assert kv.block_pool.get_num_free_blocks() == 7 and "b" not in kv.req_to_blocks
    kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == 10 and kv.usage == 0.0


@pytest.mark.parametrize("caching", [False, True])
def test_pool_reuses_uncached_blocks_first(caching):
    # 30 requests, two at a time, 9-23 tokens each (at most 6 blocks of 4). Without caching, the
    # blocks ever handed out stay within what two requests hold at once, not the pool of 200.
    # With caching, full blocks stay cached (LRU) and only each request's partial last block is
    # reused: the blocks touched are the full ones plus the last pair's partial ones.
    kv = KVCacheManager(num_blocks=200, block_size=4, enable_caching=caching)
    lengths = [9 + j % 15 for j in range(30)]
    seen: set[int] = set()
    for i in range(0, 30, 2):
        pair = [make_req(str(j), lengths[j], first=1000 * j) for j in (i, i + 1)]
        for r in pair:
            assert kv.allocate_slots(r, r.num_prompt_tokens)
            seen.update(kv.get_block_ids(r.request_id))
        for r in pair:
            r.num_computed_tokens = r.num_prompt_tokens
            kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == 200
    if not caching:
        assert len(seen) <= 12 and kv.block_pool.num_cached_free_blocks == 0
    else:
        full = sum(n // 4 for n in lengths)
        assert kv.block_pool.num_cached_free_blocks == full
        assert full < len(seen) <= full + 2


def test_prefix_cache_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", 8)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 8)
    b = make_req("b", 8)  # identical prompt: both blocks are cached, but one token must run
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and blocks == kv.req_to_blocks["a"][:1]
    c = make_req("c", 9)
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8
    assert kv.allocate_slots(c, 1, blocks)
    assert kv.get_block_ids("c")[:2] == kv.get_block_ids("a")
    assert kv.req_to_blocks["a"][0].ref_cnt == 2


def test_fork_and_copy_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a, b = make_req("a", 6), make_req("b", 6)
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = b.num_computed_tokens = 6
    kv.fork(a, b)
    shared = kv.req_to_blocks["a"]
    assert [x.ref_cnt for x in shared] == [2, 2] and kv.block_pool.get_num_free_blocks() == 8
    a.append_output_token(1)
    assert kv.allocate_slots(a, 1)  # writes slot 6 of the shared, partly filled block 1
    assert kv.get_block_ids("a")[0] == kv.get_block_ids("b")[0]
    assert kv.get_block_ids("a")[1] != kv.get_block_ids("b")[1]
    assert kv.take_pending_copies() == [(kv.get_block_ids("b")[1], kv.get_block_ids("a")[1])]
    kv.free(a)
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 10


def _run_fake_steps(sched: Scheduler, max_steps: int = 200) -> list:
    log = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        log.append(out)
        sched.update_from_output(out, {r.request_id: 7 for r, _ in out.scheduled})
    return log


def test_scheduler_fcfs_budget_and_chunked_prefill():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64), kv)
    for i, n in enumerate([20, 3, 5]):
        sched.add_request(make_req(f"r{i}", n, max_tokens=3, first=100 * i))
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 8)]  # chunk 1 of 20
    assert out.total_num_scheduled_tokens == 8
    log = [out]
    sched.update_from_output(out, {})
    log += _run_fake_steps(sched)
    for step in log:
        assert step.total_num_scheduled_tokens <= 8
        assert len(step.scheduled) <= 2
    r0_chunks = [n for step in log for r, n in step.scheduled if r.request_id == "r0" and n > 1]
    assert r0_chunks[:3] == [8, 8, 4]
    assert not sched.has_unfinished_requests() and kv.block_pool.get_num_free_blocks() == 64


def test_scheduler_preempts_newest_and_requeues_front():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)
    a, b = make_req("a", 8, max_tokens=6), make_req("b", 8, max_tokens=6, first=50)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"] and kv.block_pool.get_num_free_blocks() == 0
    sched.update_from_output(out, {"a": 1, "b": 2})
    out = sched.schedule()  # a needs a third block: b (newest) is preempted
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert out.preempted == [b] and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert b.status == RequestStatus.PREEMPTED and sched.num_preemptions == 1
    sched.update_from_output(out, {"a": 1})
    _run_fake_steps(sched)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert b.output_token_ids[0] == 2  # kept across preemption; later tokens recomputed
    assert kv.block_pool.get_num_free_blocks() == 4


def test_scheduler_abort_frees_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(make_req("a", 9))
    sched.add_request(make_req("w", 9, first=30))
    sched.schedule()
    sched.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert kv.block_pool.get_num_free_blocks() == 8 and not sched.has_unfinished_requests()


def test_priority_policy_admits_urgent_first_and_preempts_least_urgent():
    """--scheduling-policy priority: waiting requests are admitted by (priority, arrival), running
    ones served in that order, and when blocks run out the least urgent running request is
    preempted (not the newest); it waits again in its place. FCFS on the same requests preempts the
    newest and admits in arrival order."""
    def run(policy: str):
        kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                          policy=policy), kv)
        reqs = {}
        for i, (rid, prio) in enumerate([("low", 5), ("mid", 1), ("urgent", -3)]):
            r = make_req(rid, 8, max_tokens=6, first=50 * i)
            r.priority, r.metrics.arrival_time = prio, float(i)  # arrival order: low, mid, urgent
            reqs[rid] = r
            sched.add_request(r)
        first = sched.schedule()
        sched.update_from_output(first, {r.request_id: 1 for r, _ in first.scheduled})
        second = sched.schedule()  # each holds 2 blocks of 6: the first to need a third preempts
        return sched, kv, reqs, first, second

    sched, kv, reqs, first, second = run("priority")
    assert [r.request_id for r, _ in first.scheduled] == ["urgent", "mid", "low"]
    assert [r.request_id for r in sched.running] == ["urgent", "mid"] and second.preempted == [reqs["low"]]
    assert [r.request_id for r, _ in second.scheduled] == ["urgent", "mid"] and list(sched.waiting) == [reqs["low"]]
    late = make_req("later-urgent", 4, max_tokens=2, first=300)
    late.priority, late.metrics.arrival_time = -3, 9.0
    sched.add_request(late)  # ahead of "low" however late it came
    assert [r.request_id for r in sched.waiting] == ["later-urgent", "low"]
    sched.update_from_output(second, {r.request_id: 1 for r, _ in second.scheduled})
    _run_fake_steps(sched)
    assert all(r.num_output_tokens == 6 for r in reqs.values()) and kv.block_pool.get_num_free_blocks() == 6

    sched, kv, reqs, first, second = run("fcfs")
    assert [r.request_id for r, _ in first.scheduled] == ["low", "mid", "urgent"]
    assert second.preempted == [reqs["urgent"]] and sched.waiting[0] is reqs["urgent"]
