"""The vllm:* series of /metrics (pagedllm/metrics.py VLLM_NAMES): each pagedllm:* family again under vLLM's
name, with the same samples, labels and values, for one engine and for data-parallel replicas."""
from __future__ import annotations

import re
import types

from pagedllm import metrics as M
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def snapshot(running=3, waiting=1, usage=0.25, replicas=None, spec_decode=None):
    stats = types.SimpleNamespace(num_running=running, num_waiting=waiting, kv_cache_usage=usage, num_preemptions=2,
                                  prefix_cache_queries=40, prefix_cache_hits=16)
    return types.SimpleNamespace(stats=stats, num_blocks=100, num_free_blocks=70, num_cached_free_blocks=5,
                                 prompt_tokens_total=120, generation_tokens_total=33, replicas=replicas,
                                 spec_decode=spec_decode)


def samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, its label set as written) -> value."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def out(reason):
    return CompletionOutput(index=0, text="a", token_ids=[5], cumulative_logprob=None, logprobs=None,
                            finish_reason=reason)


def check_same(text: str) -> int:
    got = samples(text)
    compared = 0
    for ours, theirs in M.VLLM_NAMES.items():
        mine = {(n, lab): v for (n, lab), v in got.items() if n.startswith(ours) and not n.endswith("_created")}
        # (no request ended: no samples; no speculative decoding: no spec_decode families)
        assert mine or ours == "pagedllm:request_success" or ours.startswith("pagedllm:spec_decode"), ours
        for name in theirs:
            for (n, lab), v in mine.items():
                assert got[(name + n[len(ours):], lab)] == v, (name, n, lab)
                compared += 1
    return compared


def test_vllm_names_equal_ours_after_requests():
    m = M.ServerMetrics(lambda: snapshot(), "demo")
    for i, reason in enumerate(("stop", "length", "length")):
        rid = f"r{i}"
        first = RequestOutput(rid, "p", [1, 2], None, [out(None)], False,
                              metrics=RequestMetrics(arrival_time=100.0))
        first.metrics.first_token_time = first.metrics.last_token_time = 100.05 + i / 100
        m.record_outputs([first])
        last = RequestOutput(rid, "p", [1, 2], None, [out(reason)], True,
                             metrics=RequestMetrics(arrival_time=100.0))
        last.metrics.first_token_time = first.metrics.first_token_time
        last.metrics.last_token_time = last.metrics.finished_time = 100.2 + i / 100
        m.record_outputs([last])
    m.record_abort("gone")
    text = m.render().decode()
    assert check_same(text) > 50
    got = samples(text)
    assert got[("vllm:num_requests_running", '{model_name="demo"}')] == 3
    assert got[("vllm:gpu_cache_usage_perc", '{model_name="demo"}')] == 0.25
    assert got[("vllm:prompt_tokens_total", '{model_name="demo"}')] == 120
    assert got[("vllm:request_success_total", '{finished_reason="length",model_name="demo"}')] == 2
    assert got[("vllm:request_success_total", '{finished_reason="abort",model_name="demo"}')] == 1
    assert got[("vllm:time_to_first_token_seconds_count", '{model_name="demo"}')] == 3
    assert got[("vllm:time_per_output_token_seconds_count", '{model_name="demo"}')] == 3
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text and "# TYPE vllm:kv_cache_usage_perc gauge" in text


def test_vllm_names_per_replica():
    snap = snapshot(running=5, replicas=[snapshot(running=2), snapshot(running=3)])
    text = M.ServerMetrics(lambda: snap, "demo").render().decode()
    assert check_same(text) > 20
    got = samples(text)
    assert got[("vllm:num_requests_running", '{engine="1",model_name="demo"}')] == 3
    assert got[("vllm:num_requests_running", '{engine="all",model_name="demo"}')] == 5


def test_spec_decode_counters_under_both_names():
    spec = types.SimpleNamespace(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=25,
                                 accepted_per_pos=[9, 8, 5, 3])
    text = M.ServerMetrics(lambda: snapshot(spec_decode=spec), "demo").render().decode()
    check_same(text)
    got = samples(text)
    for prefix in ("vllm", "pagedllm"):
        assert got[(f"{prefix}:spec_decode_num_drafts_total", '{model_name="demo"}')] == 10
        assert got[(f"{prefix}:spec_decode_num_draft_tokens_total", '{model_name="demo"}')] == 40
        assert got[(f"{prefix}:spec_decode_num_accepted_tokens_total", '{model_name="demo"}')] == 25
        assert got[(f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total",
                    '{model_name="demo",position="2"}')] == 5
    assert "spec_decode" not in M.ServerMetrics(lambda: snapshot(), "demo").render().decode()
