"""Pipeline parallelism on a CPU with gloo: PP = 2 and TP = 2 x PP = 2 (4 ranks) give the greedy
tokens of one process (logprobs within 1e-4) with preemption and prefix caching, with two batches
in flight (and synchronously); a request is never scheduled or preempted while its batch is in
flight, and aborting it then frees its blocks when the batch returns; each stage keeps the KV
cache of its own layers only; a stage that dies makes the engine raise instead of hanging; no
worker outlives the engine; PP larger than the layer count is a clear error."""
from __future__ import annotations

import os
import signal
import threading
from collections import deque

import pytest

from conftest import assert_pool_empty
from pagedllm import LLM
from pagedllm.distributed.parallel_state import pp_layer_range
from pagedllm import SamplingParams
from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import RequestStatus
from pagedllm.engine.scheduler import Scheduler
from test_block_pool_scheduler import make_req
from test_tensor_parallel import (PROMPT_LENS, assert_same_outputs, generate_while_killing, make_prompts, run,
                                  wait_gone, worker_pids)

BLOCKS = 12  # a small pool: 14 prompts of up to 96 + 10 tokens cannot all run at once -> preemption
# Many concurrent requests (two sets of 7, each with a shared prefix), so two batches can be in flight.
MANY = make_prompts(500) + make_prompts(500, PROMPT_LENS[::-1], seed=1)
# K and V bytes of one 16-token block per layer per KV head of the tiny Llama (head_dim 16, fp32).
BLOCK_BYTES_PER_LAYER_HEAD = 2 * 16 * 16 * 4


def make_llm(llama_dir: str, tp: int = 1, pp: int = 1) -> LLM:
    layers_per_rank, heads_per_rank = 2 // pp, 2 // tp
    return LLM(llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=128,
               kv_cache_memory=BLOCKS * BLOCK_BYTES_PER_LAYER_HEAD * layers_per_rank * heads_per_rank,
               max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = make_llm(llama_dir)
    prompts = MANY
    out = run(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0  # the setting does preempt
    return prompts, out


def test_layer_split():
    assert [pp_layer_range(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]  # the last stage takes the extra
    assert [pp_layer_range(7, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        pp_layer_range(2, 0, 3)


def check_inflight_rules(engine) -> list[int]:
    """Wrap the scheduler: no request of a batch in flight is scheduled or preempted again.
    Returns the list that receives the number of batches in flight after each schedule."""
    sched, counts = engine.scheduler, []
    orig = sched.schedule

    def schedule():
        before = set(sched.inflight)
        out = orig()
        assert not before & {r.request_id for r, _ in out.scheduled}
        assert not before & {r.request_id for r in out.preempted}
        counts.append(len(engine._inflight) + (not out.is_empty))
        return out

    sched.schedule = schedule
    return counts


@pytest.mark.parametrize("tp,pp,depth", [(1, 2, 2), (2, 2, 2), (1, 2, 1)])
def test_pp_matches_one_process(llama_dir, reference, tp, pp, depth):
    prompts, ref = reference
    llm = make_llm(llama_dir, tp, pp)
    engine = llm.llm_engine
    pids = worker_pids(llm)
    try:
        assert len(pids) == tp * pp - 1
        assert engine.config.cache_config.num_blocks == BLOCKS
        assert engine.pipeline_depth == pp  # batches in flight by default
        engine.pipeline_depth = depth
        runner = engine.executor.driver.runner
        # Rank 0 is stage 0: it holds layer 0's KV cache and no other.
        assert [c is not None for c in runner.kv_caches] == [True, False]
        counts = check_inflight_rules(engine)
        assert_same_outputs(ref, run(llm, prompts))
        assert engine.max_inflight_batches == (depth if depth > 1 else 0)  # 0: the synchronous path
        assert max(counts) == depth and counts.count(depth) > 10  # not once by chance
        assert engine.scheduler.num_preemptions > 0
        assert engine.get_stats().prefix_cache_hits > 0
        assert not engine.scheduler.inflight
        assert_pool_empty(llm)
    finally:
        engine.shutdown()
    assert wait_gone(pids, 10) == []


def test_pp_parallel_sampling_forks_while_batches_are_in_flight(llama_dir):
    """n = 3 (the samples fork from the prompt's blocks, copy-on-write) with preemption: the same
    greedy samples as one process."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    prompts = [{"prompt_token_ids": p} for p in MANY[:10]]
    got = []
    for pp in (1, 2):
        llm = make_llm(llama_dir, pp=pp)
        try:
            got.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp, use_tqdm=False)])
            assert llm.llm_engine.scheduler.num_preemptions > 0
            assert llm.llm_engine.max_inflight_batches == (2 if pp == 2 else 0)
            assert_pool_empty(llm)
        finally:
            llm.llm_engine.shutdown()
    assert got[0] == got[1] and all(len(set(map(tuple, s))) == 1 for s in got[0])


def test_scheduler_never_preempts_a_request_in_flight():
    """Scheduler alone, two batches in flight: a request whose batch is out is skipped and never
    chosen as the victim (the request that needs the block preempts itself instead)."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv,
                      pipeline_depth=2)
    a, b = make_req("a", 8, max_tokens=6), make_req("b", 8, max_tokens=6, first=50)
    sched.add_request(a)
    sched.add_request(b)
    batch_a, batch_b = sched.schedule(), sched.schedule()  # a fair share each: one request per batch
    assert [r for r, _ in batch_a.scheduled] == [a] and [r for r, _ in batch_b.scheduled] == [b]
    assert sched.inflight == {"a", "b"} and sched.schedule().is_empty and kv.block_pool.get_num_free_blocks() == 0
    sched.update_from_output(batch_a, {"a": 1})
    out = sched.schedule()  # a needs a third block; b (newer) is in flight, so a goes back to waiting
    assert out.scheduled == [] and out.preempted == [a] and sched.waiting[0] is a
    assert b.status == RequestStatus.RUNNING and len(kv.get_block_ids("b")) == 2
    sched.update_from_output(batch_b, {"b": 2})
    queue = deque()
    for _ in range(100):  # the rest, two batches in flight at most
        while len(queue) < 2 and not (out := sched.schedule()).is_empty:
            assert not {r.request_id for r, _ in out.scheduled} & {r.request_id for o in queue for r, _ in o.scheduled}
            queue.append(out)
        if not queue:
            break
        done = queue.popleft()
        sched.update_from_output(done, {r.request_id: 7 for r, _ in done.scheduled})
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6 and a.output_token_ids[0] == 1
    assert not sched.has_unfinished_requests() and not sched.inflight
    assert kv.block_pool.get_num_free_blocks() == 4


def test_abort_in_flight_frees_blocks_when_its_batch_returns(llama_dir):
    llm = make_llm(llama_dir, pp=2)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    try:
        prompts = make_prompts(500, [5, 6, 7, 8])  # and a fifth sharing a prefix
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        for _ in range(4):
            engine.step()
        assert len(engine._inflight) == 1
        (flying,) = [sorted(r.request_id for r, _ in b[0].scheduled) for b in engine._inflight]
        assert flying and set(flying) == engine.scheduler.inflight
        finals = engine.abort_request(flying)
        assert [o.finished for o in finals] == [True] * len(flying)
        assert all(o.outputs[0].finish_reason == "abort" for o in finals)
        assert engine.get_num_unfinished_requests() == len(prompts) - len(flying)
        assert all(rid in kv.req_to_blocks for rid in flying)  # the stages still use them
        with pytest.raises(ValueError, match="still in use"):  # its blocks are still in use
            engine.add_request(flying[0], {"prompt_token_ids": [9, 10, 11]}, sp)
        outs = engine.step()  # the aborted batch returns: no output for it, blocks freed
        assert not {o.request_id for o in outs} & set(flying)
        assert not set(flying) & set(kv.req_to_blocks)
        reused = flying[0]  # now free again
        engine.add_request(reused, {"prompt_token_ids": [9, 10, 11]}, sp)
        rest = [f"r{i}" for i in range(len(prompts)) if f"r{i}" not in flying]
        assert engine.scheduler.inflight and engine.scheduler.inflight <= set(rest)  # the next batch
        engine.abort_request(rest)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert list(finals) == [reused] and len(finals[reused].outputs[0].token_ids) == 30
        assert_pool_empty(llm)
    finally:
        engine.shutdown()


def test_pp_larger_than_layers_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM(llama_dir, pipeline_parallel_size=3, kv_cache_memory=1 << 20)


def test_dead_stage_fails_fast(llama_dir):
    llm = make_llm(llama_dir, pp=2)
    engine = llm.llm_engine
    (pid,) = worker_pids(llm)
    try:
        hung, error = generate_while_killing(llm, pid, max_tokens=100)
        assert not hung, "the engine hung after a pipeline stage died"
        assert isinstance(error, RuntimeError) and "rank 1" in str(error)
        with pytest.raises(RuntimeError, match="worker died"):
            engine.check_health()
    finally:
        engine.shutdown()
    assert wait_gone([pid], 5) == []


def test_models_without_stage_support_are_refused():
    from pagedllm.models.gemma2 import Gemma2ForCausalLM
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.opt import OPTForCausalLM
    from pagedllm.models.phi3 import Phi3ForCausalLM
    from pagedllm.worker.pp_runner import check_pp_support

    for cls in (LlamaForCausalLM, Gemma2ForCausalLM, Phi3ForCausalLM, OPTForCausalLM):
        check_pp_support(cls)

    class NoStages(LlamaForCausalLM):  # a forward that does not take the previous stage's tensors
        def forward(self, input_ids, positions, kv_caches, meta):
            return super().forward(input_ids, positions, kv_caches, meta)

    class Flagged(LlamaForCausalLM):
        supports_pp = False

    for cls in (NoStages, Flagged):
        with pytest.raises(ValueError, match=f"not implemented for {cls.__name__}"):
            check_pp_support(cls)


def test_server_stage_killed_under_load_exits_nonzero(llama_dir, tmp_path):
    """A stage dies while streams keep batches in flight: every stream ends (no hang) and the
    server exits non-zero by itself."""
    import httpx

    from server_utils import RemoteServer, wait_unhealthy
    from test_tensor_parallel import worker_ranks

    args = ("--pipeline-parallel-size", "2", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
            "--served-model-name", "tiny", "--disable-access-log")
    streaming, ended = threading.Barrier(9), []

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 250, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
                streaming.wait(30)
                for _ in lines:
                    pass
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass
        ended.append(i)

    with RemoteServer(llama_dir, args, log_path=str(tmp_path / "server.log")) as srv:
        (pid,) = worker_ranks(srv.proc.pid)
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        streaming.wait(60)  # every stream has its first chunk: the pipeline is busy
        os.kill(pid, signal.SIGKILL)
        wait_unhealthy(srv, 60)  # a hang guard
        srv.proc.wait(timeout=30)
        for t in threads:
            t.join(30)
    assert sorted(ended) == list(range(8))
    assert srv.returncode not in (0, None), srv.log()
    assert "worker died" in srv.log() and "rank 1" in srv.log()
    assert wait_gone([pid], 5) == []
