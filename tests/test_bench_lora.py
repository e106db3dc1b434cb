"""Smoke test of ``pagedllm bench lora`` on a tiny checkpoint: the runs, their ratios, the op comparison."""
from __future__ import annotations

import json
import os

from pagedllm.benchmarks.cli import main


def test_lora_bench(llama_dir, tmp_path):
    out = str(tmp_path / "res")
    main(["bench", "lora", "--model", llama_dir, "--num-prompts", "4", "--num-adapters", "1", "2", "--rank", "4", "--op-repeats", "1", "--max-output-len", "8",
          "--kv-cache-memory", str(8 << 20), "--output-dir", out])
    r = json.load(open(os.path.join(out, "lora.json")))
    assert list(r["runs"]) == ["base", "base (lora engine)", "1 adapters", "2 adapters"]
    assert r["runs"]["base"]["ratio_to_base"] == 1.0
    assert all(v["output_tok_s"] > 0 for v in r["runs"].values())
    assert set(r["op"]) == {"decode48/qkv", "decode48/gate_up", "prefill2048/qkv", "prefill2048/gate_up"}
    assert all(v["grouped_us"] > 0 and v["bmm_us"] > 0 for v in r["op"].values())
    assert sorted(os.listdir(os.path.join(out, "lora_adapters"))) == ["r4-0", "r4-1"]
