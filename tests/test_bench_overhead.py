"""``pagedllm bench overhead`` end to end at tiny sizes: its JSON has every phase for every batch
size and bar setting, each a positive number of µs, and the phases add up to the step they split;
with --served, every streamed token counted. Timings are never compared with thresholds here."""
from __future__ import annotations

import glob
import json
import math
import os

import pytest

from pagedllm.benchmarks.cli import main
from pagedllm.benchmarks.overhead import PHASES


def test_overhead_bench_phases_sum_to_the_step(tmp_path):
    out = str(tmp_path / "res")
    main(["bench", "overhead", "--batch-sizes", "1,4", "--steps", "3", "--prompt-len", "5", "--vocab-size", "300",
          "--repeats", "2", "--output-dir", out])
    (path,) = glob.glob(os.path.join(out, "overhead-*.json"))
    with open(path) as f:
        r = json.load(f)
    assert r["bench"] == "overhead" and r["batch_sizes"] == [1, 4] and r["phases"] == list(PHASES)
    assert [(x["batch_size"], x["progress_bar"]) for x in r["runs"]] == [(1, False), (1, True), (4, False), (4, True)]
    for x in r["runs"]:
        assert x["decode_steps"] == 3  # the prefill step is not counted; every output token after it is
        phases = x["phases_us"]
        assert set(phases) == set(PHASES)
        # Measured phases run in every decode step; the derived rest of the engine's step is >= 0.
        assert all(phases[k] > 0 for k in PHASES if k != "engine_other"), phases
        assert phases["engine_other"] >= 0
        assert math.isclose(sum(phases.values()), x["step_us_timed"], rel_tol=1e-6)
        assert len(x["step_us_all"]) == 2 and x["step_us"] == min(x["step_us_all"]) > 0
        assert math.isclose(x["us_per_seq_step"], x["step_us"] / x["batch_size"])
        assert math.isclose(sum(x["phases_us_per_seq"].values()) * x["batch_size"], x["step_us_timed"],
                            rel_tol=1e-6)
    assert set(r["bar_over_no_bar"]) == {"1", "4"} and all(v > 0 for v in r["bar_over_no_bar"].values())
    for key in ("command", "versions", "machine"):
        assert key in r


def test_overhead_bench_served(tmp_path):
    pytest.importorskip("httpx")
    out = str(tmp_path / "res")
    main(["bench", "overhead", "--batch-sizes", "1,3", "--steps", "2", "--prompt-len", "4", "--vocab-size", "300",
          "--repeats", "1", "--bar", "off", "--served", "--served-timeout", "120", "--output-dir", out])
    (path,) = glob.glob(os.path.join(out, "overhead-*.json"))
    with open(path) as f:
        r = json.load(f)
    assert [x["progress_bar"] for x in r["runs"]] == [False, False]
    assert [(s["batch_size"], s["output_tokens"]) for s in r["served"]] == [(1, 3), (3, 9)]  # steps + 1 each
    for s in r["served"]:
        assert s["failed_requests"] == 0 and s["first_error"] is None
        assert s["wall_s"] > 0 and math.isclose(s["tokens_per_s"], s["output_tokens"] / s["wall_s"])
    (log,) = glob.glob(os.path.join(out, "overhead-serve-*.log"))
    assert os.path.getsize(log) > 0
