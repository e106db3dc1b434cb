"""Smoke tests of ``pagedllm bench``: every command end to end on a tiny checkpoint, and the
documented fields of its JSON result with sane values. Timings are never asserted here."""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pagedllm.benchmarks import datasets as ds
from pagedllm.benchmarks.throughput import static_batches

try:
    import matplotlib  # noqa: F401  (plots are optional: without it only the JSON is written)

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


def bench(args: list[str], out_dir: str) -> dict:
    """Run ``pagedllm bench ARGS`` in this process through the main CLI; return its JSON result."""
    try:
        from pagedllm.entrypoints.cli import main
    except ImportError:
        from pagedllm.benchmarks.cli import main
    before = set(glob.glob(os.path.join(out_dir, "*.json")))
    main(["bench", *args, "--output-dir", out_dir])
    new = sorted(set(glob.glob(os.path.join(out_dir, "*.json"))) - before)
    assert len(new) == 1, new
    with open(new[0]) as f:
        result = json.load(f)
    if HAVE_MPL:
        assert os.path.exists(result["plot"]) and os.path.getsize(result["plot"]) > 1000
    for key in ("command", "argv", "versions", "machine"):
        assert key in result
    assert result["versions"]["torch"] and result["versions"]["transformers"]
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["ram_bytes"] > 0
    return result


def assert_stats(s: dict) -> None:
    assert s["count"] > 0
    assert 0 <= s["min"] <= s["median"] <= s["p99"] <= s["max"]
    assert s["min"] <= s["mean"] <= s["max"]


def ns(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ds.add_dataset_args(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


# ---- workloads -------------------------------------------------------------------------------
def test_datasets_seeded_and_shaped():
    a = ns(dataset="sharegpt-like", num_prompts=200, input_len=100, output_len=40, seed=3)
    r1 = ds.sample_requests(a, 1000, special_ids=[0, 1, 2])
    r2 = ds.sample_requests(a, 1000, special_ids=[0, 1, 2])
    assert [(r.prompt_token_ids, r.output_len) for r in r1] == [(r.prompt_token_ids, r.output_len) for r in r2]
    assert all(25 <= r.prompt_len <= 400 and 10 <= r.output_len <= 160 for r in r1)
    assert len({r.prompt_len for r in r1}) > 20  # mixed lengths
    assert all(3 <= t < 1000 for r in r1 for t in r.prompt_token_ids)
    fixed = ds.sample_requests(ns(dataset="random", num_prompts=5, input_len=7, output_len=3), 50)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(7, 3)] * 5
    d = ds.describe(a, r1)
    assert d["total_prompt_tokens"] == sum(r.prompt_len for r in r1)
    assert "LogNormal" in d["distribution"]


def test_static_batches_fit_the_budget():
    reqs = ds.sample_requests(ns(num_prompts=50, input_len=30, output_len=10), 100)
    batches = static_batches(reqs, 400, None)
    assert sorted(i for b in batches for i in b) == list(range(50))
    for b in batches:
        width = max(reqs[i].prompt_len for i in b) + max(reqs[i].output_len for i in b)
        assert len(b) == 1 or len(b) * width <= 400
    assert [len(b) for b in static_batches(reqs, 400, 8)] == [8] * 6 + [2]


# ---- commands --------------------------------------------------------------------------------
def test_throughput_all_backends(llama_dir, tmp_path):
    r = bench(["throughput", "--model", llama_dir, "--backend", "all", "--num-prompts", "8", "--input-len", "16",
               "--output-len", "6", "--kv-fraction", "0.4"], str(tmp_path))
    wl = r["workload"]
    assert wl["num_prompts"] == 8
    b = r["budget"]
    assert b["budget_tokens"] == b["kv_cache_bytes"] // b["kv_bytes_per_token"] > 0
    assert set(r["results"]) == {"pagedllm", "hf", "hf-cb"}
    for name, res in r["results"].items():
        if "skipped" in res:
            assert name == "hf-cb" and res["skipped"]
            continue
        assert res["num_requests"] == 8 == len(res["per_request"])
        assert res["total_output_tokens"] == wl["total_output_tokens"]
        assert res["total_prompt_tokens"] == wl["total_prompt_tokens"]
        assert res["elapsed_s"] > 0
        assert res["output_tokens_per_s"] == pytest.approx(res["total_output_tokens"] / res["elapsed_s"])
        assert res["total_tokens_per_s"] > res["output_tokens_per_s"] > 0
        assert_stats(res["e2e_ms"])
        for p in res["per_request"]:
            if name == "hf":
                assert p["generated"] >= p["output_len"]  # a static batch runs to its longest output
            else:
                assert p["generated"] == p["output_len"]
    paged = r["results"]["pagedllm"]
    assert_stats(paged["ttft_ms"])
    assert all(p["ttft_s"] <= p["e2e_s"] for p in paged["per_request"])
    assert paged["num_steps"] == len(paged["steps"]) > 0
    assert 1 <= paged["max_running"] <= 8
    hf = r["results"]["hf"]
    assert sum(b["size"] for b in hf["batches"]) == 8
    assert 0 < hf["useful_output_fraction"] <= 1
    assert "pagedllm/hf" in r["ratios"]
    assert r["ratios"]["pagedllm/hf"]["output_tokens_per_s"] == pytest.approx(
        paged["output_tokens_per_s"] / hf["output_tokens_per_s"])


def test_memory(llama_dir, tmp_path):
    args = ["memory", "--model", llama_dir, "--num-prompts", "10", "--input-len", "40", "--output-len", "12",
            "--max-model-len", "512", "--kv-fraction", "0.5"]
    r = bench(args, str(tmp_path))
    schemes = r["schemes"]
    paged, cmax, oracle = schemes["paged (pagedllm)"], schemes["contiguous-max"], schemes["contiguous-oracle"]
    slots = r["budget"]["slots"]
    assert paged["forward"] == "real" and paged["all_requests_full_length"]
    assert paged["num_preemptions"] >= 0
    for name, sm in schemes.items():
        assert 0 < sm["utilization"] <= 1 and sm["waste"] == pytest.approx(1 - sm["utilization"])
        assert 1 <= sm["max_requests_held"] <= 10
        steps = r["steps"][name]
        assert len(steps) == sm["num_steps"] > 0
        assert all(0 <= s["live"] <= s["reserved"] <= slots for s in steps)
        assert steps[-1]["running"] == 0 and steps[-1]["waiting"] == 0
    # Paged blocks hold at most one partly filled block per request.
    bs = paged["block_size"]
    assert all(s["reserved"] - s["live"] < bs * max(1, s["running"]) for s in r["steps"]["paged (pagedllm)"])
    assert all(s["table_blocks"] * bs == s["reserved"] for s in r["steps"]["paged (pagedllm)"])
    assert paged["waste"] < cmax["waste"]
    assert cmax["max_requests_held"] == min(10, slots // 512)
    assert oracle["max_requests_held"] >= cmax["max_requests_held"]
    # The schedule does not depend on the forward pass: --skip-forward gives the same steps.
    r2 = bench(args + ["--skip-forward"], str(tmp_path / "stubbed"))  # own dir: result files are named by the second
    assert [s["running"] for s in r2["steps"]["paged (pagedllm)"]] == \
        [s["running"] for s in r["steps"]["paged (pagedllm)"]]
    assert r2["schemes"]["paged (pagedllm)"]["forward"] == "stubbed"


def test_profile(llama_dir, tmp_path):
    r = bench(["profile", "--model", llama_dir, "--batch-size", "3", "--context-len", "20", "--steps", "2"],
              str(tmp_path))
    assert r["step_s"] > 0 and r["decode_tokens_per_s"] == pytest.approx(3 / r["step_s"])
    fr = r["breakdown_fraction"]
    assert sum(fr.values()) == pytest.approx(1.0)
    for part in ("linear: qkv_proj", "linear: down_proj", "attention (paged: KV write, gather, SDPA)", "sampler",
                 "lm_head (logits)", "engine: schedule"):
        assert r["breakdown_s"][part] > 0, part
    assert r["top_ops"] and 0 <= r["outside_aten_fraction"] <= 1
    assert r["flops_per_step"] > 0 and r["floor"]["floor_s"] > 0
    f = r["floor"]  # max(sum, sum) <= sum of per-phase maxima <= sum of all (1e-9: float rounding)
    assert f["floor_s"] <= f["phases_floor_s"] * (1 + 1e-9)
    assert f["phases_floor_s"] <= (f["compute_floor_s"] + f["memory_floor_s"]) * (1 + 1e-9)
    assert glob.glob(os.path.join(str(tmp_path), "profile-*-ops.txt"))


# ---- serve: a real `pagedllm serve` process ----------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    pytest.importorskip("pagedllm.entrypoints.openai.api_server")
    import httpx

    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_dir, "--port", str(port),
                             "--served-model-name", "tiny", "--max-model-len", "256", "--disable-access-log"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("rate,concurrency", [("inf", "3"), ("40", None)])
def test_serve(server, llama_dir, tmp_path, rate, concurrency):
    args = ["serve", "--base-url", server, "--model", "tiny", "--tokenizer", llama_dir, "--num-prompts", "8",
            "--input-len", "16", "--output-len", "6", "--request-rate", rate]
    if concurrency:
        args += ["--max-concurrency", concurrency]
    r = bench(args, str(tmp_path))
    assert r["completed"] == r["num_requests"] == 8 and r["failed"] == 0 and not r["errors"]
    assert r["total_output_tokens"] == r["target_output_tokens"] == r["workload"]["total_output_tokens"]
    assert r["request_throughput"] == pytest.approx(8 / r["duration_s"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert_stats(r[key])
    for p in r["per_request"]:
        assert p["success"] and p["output_tokens"] == p["output_len"]
        assert 0 < p["ttft_s"] <= p["e2e_s"]
        assert p["start_s"] >= 0
        assert p["ttft_s"] + sum(p["itl_s"]) <= p["e2e_s"] + 1e-6
    assert r["ttft_ms"]["mean"] <= r["e2e_ms"]["mean"]
