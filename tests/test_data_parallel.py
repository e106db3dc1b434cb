"""Data parallelism through ``pagedllm serve --data-parallel-size 2``: greedy answers equal one
engine's, concurrent requests reach both replicas, /metrics labels every gauge by replica
(engine="0"/"1") and keeps the totals (engine="all"), a client disconnect frees the blocks of the
replica that held the request, and a killed replica makes /health 503 and the server exit
non-zero, leaving no process behind. One server for the module (start-up dominates the time);
the kill test runs last."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from server_utils import RemoteServer, metric, wait_unhealthy
from test_tensor_parallel import pid_alive, spawned_children, wait_gone

ARGS = ("--data-parallel-size", "2", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
        "--served-model-name", "tiny", "--disable-access-log")
PROMPTS = [[10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [99, 98, 97], [7, 300, 301, 302, 303, 304]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    with RemoteServer(llama_dir, ARGS, log_path=str(log)) as srv:
        yield srv


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()


def replica_metric(url: str, name: str, engine: str) -> float:
    return metric(httpx.get(url + "/metrics", timeout=10).text, name, engine=engine)


def wait_idle(url: str, within_s: float = 30.0) -> str:
    """The /metrics text once no replica runs a request and every KV block is free."""
    deadline = time.monotonic() + within_s
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = [metric(text, n, engine=e) for e in ("0", "1", "all")
                for n in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                          "pagedllm:kv_cache_usage_perc")]
        if not any(busy) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_router_picks_least_work_then_takes_turns_when_idle():
    from types import SimpleNamespace

    from pagedllm.engine.dp_client import DPAsyncLLM, _Replica

    reps = [_Replica(index=i, proc=None, conn=None) for i in range(3)]
    front = SimpleNamespace(replicas=reps)
    picked = []
    for _ in range(6):  # requests that never overlap: the idle replicas take turns
        r = DPAsyncLLM.pick_replica(front)
        r.requests_routed += 1
        picked.append(r.index)
    assert picked == [0, 1, 2, 0, 1, 2]
    reps[0].outstanding["a"] = 5  # outstanding tokens come first, whatever was routed before
    reps[1].outstanding["b"] = 3
    reps[1].requests_routed = 0
    assert DPAsyncLLM.pick_replica(front).index == 2
    reps[2].outstanding["c"] = 4
    assert DPAsyncLLM.pick_replica(front).index == 1


def test_dp2_answers_equal_one_engine_and_both_replicas_work(server, llama_dir):
    ref_llm = LLM(llama_dir, kv_cache_memory=1 << 22, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = [o.outputs[0].text for o in ref_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                        use_tqdm=False)]
    del ref_llm
    # Concurrent requests: the router spreads them over the replicas by outstanding work. They
    # leave together (a barrier): requests that do not overlap all go to replica 0, which once
    # happened on a loaded host when the threads started one after another.
    got: dict[int, str] = {}
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        start.wait(30)
        got[i] = complete(server.url, PROMPTS[i])["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(PROMPTS))] == ref
    text = wait_idle(server.url)
    per = [metric(text, "pagedllm:prompt_tokens_total", engine=e) for e in ("0", "1")]
    assert all(n > 0 for n in per), (per, server.log())
    assert metric(text, "pagedllm:prompt_tokens_total", engine="all") == sum(per) == sum(len(p) for p in PROMPTS)
    gen = [metric(text, "pagedllm:generation_tokens_total", engine=e) for e in ("0", "1", "all")]
    assert gen[2] == gen[0] + gen[1] == MAX_TOKENS * len(PROMPTS)
    for e in ("0", "1", "all"):  # every block is back in each replica's pool
        assert metric(text, "pagedllm:kv_cache_usage_perc", engine=e) == 0.0
        assert metric(text, "pagedllm:num_requests_running", engine=e) == 0


def test_disconnect_aborts_on_the_right_replica(server):
    before = metric(httpx.get(server.url + "/metrics").text, "pagedllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 200, "temperature": 0.0, "n": 3,
            "ignore_eos": True, "stream": True}) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                chunks += 1
            if chunks == 2:
                break  # hang up mid-generation
    text = wait_idle(server.url)
    running = [metric(text, "pagedllm:num_requests_running", engine=e) for e in ("0", "1")]
    usage = [metric(text, "pagedllm:kv_cache_usage_perc", engine=e) for e in ("0", "1")]
    assert running == [0, 0] and usage == [0.0, 0.0], text
    assert metric(text, "pagedllm:request_success_total", finished_reason="abort") == before + 3  # one a choice
    gen = metric(text, "pagedllm:generation_tokens_total", engine="all")
    assert gen < MAX_TOKENS * len(PROMPTS) + 3 * 200  # it stopped early


def test_killed_replica_makes_health_503_and_server_exit(server):
    pids = spawned_children(server.proc.pid)
    assert len(pids) == 2, server.log()
    os.kill(pids[1], signal.SIGKILL)
    wait_unhealthy(server, 30, poll_s=0.1)  # a hang guard: the reader sees the closed pipe at once
    server.proc.wait(timeout=30)  # exits by itself
    assert server.proc.returncode not in (0, None), server.log()
    assert "replica 1" in server.log()
    assert wait_gone(pids, 15) == [], "a replica outlived the server"
    assert not pid_alive(pids[0])


def test_replica_start_failure_is_a_clear_error(llama_dir, tmp_path):
    """A replica that cannot start (KV cache too small) fails the server at once with its reason,
    and the other replica does not linger."""
    import subprocess
    import sys

    from server_utils import free_port

    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_dir, "--port",
                           str(free_port()), "--data-parallel-size", "2", "--kv-cache-memory", "1KiB"],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1
    assert "data-parallel replica" in proc.stderr and "KV cache" in proc.stderr, proc.stderr[-2000:]


def test_replicas_get_their_own_gpus(llama_dir, monkeypatch):
    """On CUDA each replica sees its own world-size slice of the GPUs; too few is a clear error."""
    import dataclasses

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.dp_client import replica_devices

    cfg = EngineArgs(model=llama_dir, device="cpu").create_engine_config()
    assert replica_devices(cfg, 2) == [None, None]
    cuda = dataclasses.replace(cfg, device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert replica_devices(cuda, 4) == ["0", "1", "2", "3"]
    tp2 = dataclasses.replace(cuda, parallel_config=dataclasses.replace(cuda.parallel_config, tensor_parallel_size=2))
    assert replica_devices(tp2, 2) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="needs 5 GPUs, found 4"):
        replica_devices(cuda, 5)
