"""Smoke test of ``pagedllm bench prefix-caching`` on a tiny checkpoint."""
from __future__ import annotations

import json
import os

from pagedllm.benchmarks.cli import main


def test_prefix_caching_bench(llama_dir, tmp_path):
    out = str(tmp_path / "res")
    main(["bench", "prefix-caching", "--model", llama_dir, "--num-prompts", "5", "--prefix-len", "100",
          "--question-len", "8", "--output-len", "4", "--kv-cache-memory", str(8 << 20), "--output-dir", out])
    r = json.load(open(os.path.join(out, "prefix_caching.json")))
    assert r["outputs_identical"] is True
    on, off = r["caching_on"], r["caching_off"]
    assert off["prefix_cache_hits"] == 0 and off["cached_tokens_per_request"] == [0] * 5
    # Requests 2..5 reuse the 6 full blocks (96 tokens) of the shared 100-token prefix.
    assert on["cached_tokens_per_request"] == [0] + [96] * 4
    assert on["ttft_ms"]["count"] == 5 and on["ttft_ms"]["median"] <= on["ttft_ms"]["p99"]
    assert os.path.exists(os.path.join(out, "prefix_caching.png"))
