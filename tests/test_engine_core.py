"""The engine core in its own process (``pagedllm serve``'s default; engine/core.py, core_client.py):
answers equal the offline engine's token for token (greedy with logprobs, seeded n > 1, a stop
string matched in the API server process), a stop string and a client disconnect free the core's
blocks, /metrics shows the core's counters, --no-engine-core-process keeps the engine in a thread,
and a SIGKILLed core ends every open stream with an error and the server exits non-zero, leaving no
process behind. One server for the module (start-up dominates the time); the kill test runs last."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from server_utils import RemoteServer, metric, wait_unhealthy
from test_tensor_parallel import all_spawned, spawned_children, wait_gone

ARGS = ("--kv-cache-memory", "4MiB", "--max-model-len", "256", "--served-model-name", "tiny", "--disable-access-log")
PROMPTS = [[10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [99, 98, 97], [7, 300, 301, 302, 303, 304]]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("core") / "server.log"
    with RemoteServer(llama_dir, ARGS, log_path=str(log)) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, kv_cache_memory=1 << 22, max_model_len=256)


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, within_s: float = 30.0) -> str:
    """The /metrics text once the core runs no request and every KV block is free."""
    deadline = time.monotonic() + within_s
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = [metric(text, n) for n in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                                          "pagedllm:kv_cache_usage_perc")]
        if not any(busy) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_one_core_process_and_the_start_up_line(server):
    (core,) = spawned_children(server.proc.pid)
    assert "engine core: its own process (pid %d)" % core in server.log(), server.log()


def test_greedy_logprobs_and_metrics_equal_the_offline_engine(server, offline):
    before = httpx.get(server.url + "/metrics", timeout=10).text
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    ref = offline.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for p, want in zip(PROMPTS, ref):
        got = complete(server.url, prompt=p, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)["choices"][0]
        w = want.outputs[0]
        assert got["text"] == w.text
        assert got["logprobs"]["token_logprobs"] == [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)]
        assert got["finish_reason"] == "length"
    text = wait_idle(server.url)
    # the core's counters reach /metrics: every prompt token and generated token of these requests
    for name, n in (("pagedllm:prompt_tokens_total", sum(map(len, PROMPTS))),
                    ("pagedllm:generation_tokens_total", 8 * len(PROMPTS))):
        assert metric(text, name) - metric(before, name) == n, name
    assert metric(text, "pagedllm:kv_cache_usage_perc") == 0.0


def test_seeded_n2_equals_the_offline_engine(server, offline):
    sp = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    (want,) = offline.generate([{"prompt_token_ids": PROMPTS[1]}], sp, use_tqdm=False)
    got = complete(server.url, prompt=PROMPTS[1], n=2, temperature=0.9, top_p=0.9, seed=123, max_tokens=10,
                   ignore_eos=True)
    assert sorted(c["text"] for c in got["choices"]) == sorted(o.text for o in want.outputs)


def test_stop_string_matched_in_the_server_frees_the_core_blocks(server, offline):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,) = offline.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 2]
    assert stop.strip() and len(stop) == 2
    (want,) = offline.generate([{"prompt_token_ids": PROMPTS[0]}],
                               SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)
    got = complete(server.url, prompt=PROMPTS[0], max_tokens=200, temperature=0.0, ignore_eos=True, stop=[stop])
    c = got["choices"][0]
    assert (c["text"], c["finish_reason"]) == (want.outputs[0].text, "stop")
    assert c["text"] == text[:text.index(stop)]
    assert got["usage"]["completion_tokens"] < 200
    metrics = wait_idle(server.url)
    assert metric(metrics, "pagedllm:num_requests_running") == 0
    assert metric(metrics, "pagedllm:kv_cache_usage_perc") == 0.0  # the core finished it too


def test_disconnect_frees_the_core_blocks(server):
    before = metric(httpx.get(server.url + "/metrics").text, "pagedllm:request_success_total", finished_reason="abort")
    gen_before = metric(httpx.get(server.url + "/metrics").text, "pagedllm:generation_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 240, "temperature": 0.0, "n": 2,
            "ignore_eos": True, "stream": True}) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                chunks += 1
            if chunks == 2:
                break  # hang up mid-generation
    text = wait_idle(server.url)
    assert metric(text, "pagedllm:num_requests_running") == 0
    assert metric(text, "pagedllm:kv_cache_usage_perc") == 0.0, text
    assert metric(text, "pagedllm:request_success_total", finished_reason="abort") == before + 2  # one a choice
    assert metric(text, "pagedllm:generation_tokens_total") - gen_before < 2 * 240  # it stopped early


def test_no_engine_core_process_keeps_the_engine_in_a_thread(llama_dir, tmp_path):
    with RemoteServer(llama_dir, ARGS + ("--no-engine-core-process",), log_path=str(tmp_path / "s.log")) as srv:
        assert spawned_children(srv.proc.pid) == []
        assert "engine core: a thread of the API server process" in srv.log()
        got = complete(srv.url, prompt=PROMPTS[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert got["usage"]["completion_tokens"] == 4
    assert srv.returncode == 0, srv.log()


def test_killed_core_ends_every_stream_with_an_error_and_the_server_exits(server):
    pids = all_spawned(server.proc.pid)
    (core,) = spawned_children(server.proc.pid)
    streaming, ended = threading.Barrier(5), {}

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 250, "ignore_eos": True, "stream": True}
        last = None
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                lines = (x for x in r.iter_lines() if x.startswith("data:"))
                next(lines)
                streaming.wait(30)
                for line in lines:
                    if line != "data: [DONE]":
                        last = json.loads(line[5:])
        except (httpx.HTTPError, threading.BrokenBarrierError) as e:
            last = repr(e)
        ended[i] = last

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    streaming.wait(60)  # every stream has its first chunk
    os.kill(core, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert sorted(ended) == [0, 1, 2, 3]
    for last in ended.values():  # each stream's last event is the engine's death, not a finish
        assert isinstance(last, dict) and last["error"]["code"] == "engine_dead", last
    wait_unhealthy(server, 30, poll_s=0.1)
    server.proc.wait(timeout=30)  # exits by itself
    assert server.proc.returncode not in (0, None), server.log()
    assert "the engine core (pid %d) died" % core in server.log()
    assert wait_gone(pids, 15) == [], "a process outlived the server"
