"""Tensor parallelism on a CPU with gloo: N ranks give the same greedy tokens as one (logprobs
within 1e-4), KV capacity grows with N, bad sizes fail with a clear ValueError, a dead rank
makes the engine raise instead of hanging, and no worker process outlives the engine."""
from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams

KV_BYTES = 1 << 22  # per rank: the same budget for every N, so capacity is comparable
PROMPT_LENS = [1, 3, 17, 40, 5, 96]


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, vocab) for _ in range(n)] for n in lens]
    prompts.append(prompts[3][:20] + [7, 8, 9])  # shares a cached prefix with another prompt
    return prompts


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], within_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.executor.procs]


def run(llm: LLM, prompts, max_tokens: int = 10):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return llm.generate(prompts, sp, use_tqdm=False)


def generate_while_killing(llm: LLM, pid: int, max_tokens: int) -> tuple[bool, BaseException | None]:
    """Generate 500-token-vocabulary prompts on ``llm`` in a thread, again and again (for up to
    30 s, so that a fast engine is still running steps), and SIGKILL ``pid`` 1 s in. Returns
    (whether the thread still ran after 60 s: a hang guard, not a speed check; what generate
    raised)."""
    result: dict = {}

    def generate():
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                run(llm, make_prompts(500), max_tokens=max_tokens)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t = threading.Thread(target=generate, daemon=True)
    t.start()
    t.join(timeout=60)
    killer.join()
    return t.is_alive(), result.get("error")


def assert_tp2_matches_tp1(model: str, prompts, **llm_kwargs) -> None:
    """TP = 2 gives TP = 1's greedy ids and logprobs on ``model`` (``llm_kwargs`` for both), and
    its pool is full again after the run."""
    ref = run(LLM(model, kv_cache_memory=KV_BYTES, **llm_kwargs), prompts)
    two = LLM(model, tensor_parallel_size=2, kv_cache_memory=KV_BYTES, **llm_kwargs)
    try:
        assert_same_outputs(ref, run(two, prompts))
        assert_pool_empty(two)
    finally:
        two.llm_engine.shutdown()


def assert_same_outputs(ref, got) -> None:
    for a, b in zip(ref, got):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids
        for t, la, lb in zip(ca.token_ids, ca.logprobs, cb.logprobs):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4


def test_tp2_matches_tp1_llama(llama_dir):
    prompts = make_prompts(500)
    one = LLM(llama_dir, tensor_parallel_size=1, kv_cache_memory=KV_BYTES, max_num_batched_tokens=64)
    ref = run(one, prompts)
    blocks_one = one.llm_engine.config.cache_config.num_blocks
    del one

    two = LLM(llama_dir, tensor_parallel_size=2, kv_cache_memory=KV_BYTES, max_num_batched_tokens=64)
    pids = worker_pids(two)
    assert len(pids) == 1 and all(pid_alive(p) for p in pids)
    got = run(two, prompts)
    assert_same_outputs(ref, got)
    # Each rank holds half the KV heads, so the same per-rank budget holds twice the blocks.
    assert two.llm_engine.config.cache_config.num_blocks == 2 * blocks_one
    assert_pool_empty(two)
    two.llm_engine.shutdown()
    assert wait_gone(pids, 5) == []
    two.llm_engine.shutdown()  # idempotent


def test_tp2_matches_tp1_qwen2_and_del_stops_workers(qwen2_dir):
    prompts = make_prompts(500, seed=1)
    ref = run(LLM(qwen2_dir, tensor_parallel_size=1, kv_cache_memory=KV_BYTES), prompts)
    two = LLM(qwen2_dir, tensor_parallel_size=2, kv_cache_memory=KV_BYTES)
    pids = worker_pids(two)
    assert_same_outputs(ref, run(two, prompts))
    del two
    gc.collect()
    assert wait_gone(pids, 10) == []
    # The process group is gone with it: a single-rank engine works again in this process.
    assert run(LLM(qwen2_dir, kv_cache_memory=KV_BYTES), prompts[:2])[0].outputs[0].token_ids == \
        ref[0].outputs[0].token_ids


def test_tp4_replicates_kv_heads(llama_dir):
    """4 ranks, 2 KV heads: each KV head lives on two ranks (as in vLLM)."""
    prompts = make_prompts(500)[:4]
    ref = run(LLM(llama_dir, kv_cache_memory=KV_BYTES), prompts, max_tokens=6)
    four = LLM(llama_dir, tensor_parallel_size=4, kv_cache_memory=KV_BYTES)
    try:
        assert four.llm_engine.executor.driver.runner.num_kv_heads == 1
        assert_same_outputs(ref, run(four, prompts, max_tokens=6))
    finally:
        four.llm_engine.shutdown()


def test_tp_not_dividing_heads_is_a_clear_error(llama_dir):
    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(llama_dir, tensor_parallel_size=3, kv_cache_memory=KV_BYTES)
    assert set(p.pid for p in multiprocessing.active_children()) <= before


def test_dead_worker_fails_fast(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2, kv_cache_memory=KV_BYTES)
    engine = llm.llm_engine
    try:
        run(llm, [[10, 11, 12]], max_tokens=2)
        (pid,) = worker_pids(llm)
        # Kill the rank while steps are running: the driver is in a step or between two.
        hung, error = generate_while_killing(llm, pid, max_tokens=400)
        assert not hung, "the engine hung after a worker died"
        assert isinstance(error, RuntimeError)
        assert "rank 1" in str(error)
        with pytest.raises(RuntimeError, match="worker died"):
            engine.check_health()
        with pytest.raises(RuntimeError):
            engine.step()  # even with nothing to schedule
    finally:
        engine.shutdown()
    assert wait_gone([pid], 5) == []


DRIVER_SCRIPT = """
import sys, time
from pagedllm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory=1 << 22)
    print("WORKERS", *[p.pid for p in llm.llm_engine.executor.procs], flush=True)
    time.sleep(600)
"""


def test_worker_exits_when_driver_is_killed(llama_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script), llama_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("WORKERS"), line
        pids = [int(x) for x in line.split()[1:]]
        assert pids and all(pid_alive(p) for p in pids)
        proc.kill()  # SIGKILL: no atexit, no shutdown; the workers must notice on their own
        proc.wait(timeout=10)
        assert wait_gone(pids, 20) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the server ------------------------------------------------------------------------------
SERVER_ARGS = ("--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
               "--served-model-name", "tiny", "--disable-access-log")


def spawned_children(pid: int) -> list[int]:
    """Worker processes (multiprocessing spawn) whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            found.append(int(entry))
    return found


def all_spawned(pid: int) -> list[int]:
    """Every spawned process below ``pid``: its children, theirs, and so on (a server's engine core
    and the worker ranks the core started)."""
    kids = spawned_children(pid)
    return kids + [g for k in kids for g in all_spawned(k)]


def worker_ranks(server_pid: int) -> list[int]:
    """The worker ranks of a one-replica server: the children of its engine core process (or, with
    --no-engine-core-process, its own children)."""
    kids = spawned_children(server_pid)
    grandkids = [g for k in kids for g in spawned_children(k)]
    return grandkids or kids


def chat(url: str):
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the king"}],
                                              max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})


def test_server_tp2_answers_and_stops_cleanly(llama_dir, tmp_path):
    from server_utils import RemoteServer

    with RemoteServer(llama_dir, SERVER_ARGS, log_path=str(tmp_path / "server.log")) as srv:
        pids = all_spawned(srv.proc.pid)
        assert len(worker_ranks(srv.proc.pid)) == 1, srv.log()
        out = chat(srv.url)
        assert out.usage.completion_tokens == 8
        assert "tp=2" in srv.log()
    assert srv.returncode == 0, srv.log()
    assert wait_gone(pids, 10) == []


def test_server_reports_dead_worker(llama_dir, tmp_path):
    from server_utils import RemoteServer, wait_unhealthy

    with RemoteServer(llama_dir, SERVER_ARGS, log_path=str(tmp_path / "server.log")) as srv:
        (pid,) = worker_ranks(srv.proc.pid)
        os.kill(pid, signal.SIGKILL)
        wait_unhealthy(srv, 60)  # a hang guard: the engine checks its workers every few seconds
        srv.proc.wait(timeout=30)  # the server stops by itself once its engine is dead
    assert not pid_alive(pid)
    assert srv.returncode not in (0, None), srv.log()
