"""Smoke test of ``pagedllm bench image`` on a tiny LLaVA checkpoint."""
from __future__ import annotations

import json
import os

from pagedllm.benchmarks.cli import main
from vision_utils import build_llava


def test_image_bench(tmp_path):
    d = str(tmp_path / "llava")
    build_llava(d)
    out = str(tmp_path / "res")
    main(["bench", "image", "--model", d, "--num-prompts", "4", "--image-size", "64", "--output-len", "3",
          "--arrival", "sequential", "--kv-cache-memory", str(4 << 20), "--output-dir", out])
    r = json.load(open(os.path.join(out, "image.json")))
    assert r["outputs_identical"] is True
    on, off = r["cache_on"], r["cache_off"]
    assert (off["mm_cache_queries"], off["mm_cache_hits"]) == (4, 0)  # encoded every time
    assert (on["mm_cache_queries"], on["mm_cache_hits"]) == (4, 3)    # encoded once
    assert on["ttft_ms"]["count"] == 4


def test_image_bench_on_a_qwen2_vl_shape(tmp_path):
    """``--model shape:qwen2-vl-tiny``: a Qwen2-VL config folder with random weights (M-RoPE, its tower)."""
    out = str(tmp_path / "res")
    main(["bench", "image", "--model", "shape:qwen2-vl-tiny", "--num-prompts", "3", "--image-size", "112",
          "--output-len", "3", "--arrival", "sequential", "--max-model-len", "512", "--kv-cache-memory", str(4 << 20), "--output-dir", out])
    r = json.load(open(os.path.join(out, "image.json")))
    assert r["outputs_identical"] is True
    on, off = r["cache_on"], r["cache_off"]
    assert (off["mm_cache_hits"], on["mm_cache_queries"], on["mm_cache_hits"]) == (0, 3, 2)
    assert on["prompt_tokens_mean"] > 16  # 112 x 112 pixels: 16 image tokens and the question
