"""Smoke test of ``pagedllm bench images`` on the tiny random Qwen2-VL shape: the encoder cache is cold in
one mode (every image encoded) and warm in the other (every image a hit), with the same ids."""
from __future__ import annotations

import json
import os

from pagedllm.benchmarks.cli import main


def test_images_bench(tmp_path):
    out = str(tmp_path / "res")
    main(["bench", "images", "--model", "shape:qwen2-vl-tiny", "--num-prompts", "3", "--image-size", "112",
          "--output-len", "4", "--kv-cache-memory", str(8 << 20), "--output-dir", out])
    r = json.load(open(os.path.join(out, "images.json")))
    assert r["outputs_identical"] is True
    cold, warm = r["encoder_cache_cold"], r["encoder_cache_warm"]
    assert (cold["encoder_cache_queries"], cold["encoder_cache_hits"]) == (3, 0)
    assert (warm["encoder_cache_queries"], warm["encoder_cache_hits"]) == (3, 3)
    # 112 x 112 pixels: 8 x 8 patches of 14, merged 2 x 2 -> 16 image tokens in each prompt
    assert cold["prompt_tokens_per_request"] > 16 and cold["ttft_ms"]["count"] == 3
    assert os.path.exists(os.path.join(out, "images.png"))
