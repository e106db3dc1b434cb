"""The ``w48`` bench dataset draws exactly the requests of the CPU comparison's side-by-side client
(``../shared/tools/side_by_side.py``, a tool outside this repository) and of its OpenVINO anchor."""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from pagedllm.benchmarks import datasets as ds

_TOOL = Path(os.environ.get("PAGEDLLM_SIDE_BY_SIDE",
                            Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "side_by_side.py"))


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ds.add_dataset_args(p)
    return p.parse_args(["--dataset", "w48", *argv])


def test_w48_defaults_and_totals_published_in_issue_10():
    # Issue 10 measured the workload's output tokens through the servers' usage counts: 3,460 with
    # a vocabulary of 8,192 and 3,320 with 49,152 (the id draws consume the generator differently).
    for vocab, want in ((8192, 3460), (49152, 3320)):
        args = _args()
        reqs = ds.sample_requests(args, vocab, special_ids=[0, 1, 2])  # specials are not excluded
        assert (args.num_prompts, args.seed) == (48, 11) and len(reqs) == 48
        assert sum(r.output_len for r in reqs) == want
        assert all(16 <= r.prompt_len <= 256 and 16 <= r.output_len <= 128 for r in reqs)
        assert all(10 <= t < vocab - 10 for r in reqs for t in r.prompt_token_ids)
    assert "U[16, 256]" in ds.describe(args, reqs)["distribution"]
    other = ds.sample_requests(_args("--seed", "12", "--num-prompts", "5"), 8192)
    assert len(other) == 5 and other[0].prompt_token_ids != reqs[0].prompt_token_ids[:len(other[0].prompt_token_ids)]
    with pytest.raises(ValueError, match="too small"):
        ds.w48_requests(3, 20, 11)


@pytest.mark.skipif(not _TOOL.is_file(), reason=f"side_by_side.py not found at {_TOOL}")
@pytest.mark.parametrize("num, vocab, seed", [(48, 8192, 11), (48, 49152, 11), (7, 300, 0)])
def test_w48_equals_side_by_side_workload(num, vocab, seed):
    pytest.importorskip("httpx")  # the tool imports it
    spec = importlib.util.spec_from_file_location("side_by_side_tool", _TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    want = tool.workload(num, vocab, seed)
    got = ds.sample_requests(_args("--num-prompts", str(num), "--seed", str(seed)), vocab)
    assert [(r.prompt_token_ids, r.output_len) for r in got] == [(list(p), o) for p, o in want]


def test_throughput_on_w48_and_matmul_bench(llama_dir, tmp_path):
    """``bench throughput --dataset w48`` runs the workload's requests; ``bench matmul`` reports both
    dtypes for every linear of the model (values only: no timing is asserted)."""
    from test_bench import bench

    r = bench(["throughput", "--model", llama_dir, "--dataset", "w48", "--num-prompts", "3",
               "--kv-cache-memory", "4MiB"], str(tmp_path))
    want = ds.w48_requests(3, 512, 11)  # the tiny checkpoint's vocabulary
    wl = r["workload"]
    assert (wl["dataset"], wl["num_prompts"], wl["seed"]) == ("w48", 3, 11)
    assert wl["total_output_tokens"] == sum(q.output_len for q in want)
    res = r["results"]["pagedllm"]
    assert [p["generated"] for p in res["per_request"]] == [q.output_len for q in want]
    m = bench(["matmul", "--model", llama_dir, "--batch-sizes", "1,4", "--reps", "1"], str(tmp_path / "mm"))
    assert {(row["batch"], row["layer"]) for row in m["rows"]} == {
        (b, n) for b in (1, 4) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")}
    qkv = next(row for row in m["rows"] if row["layer"] == "qkv_proj")
    assert (qkv["in"], qkv["out"]) == (64, 64 + 2 * 2 * 16)  # hidden 64; 4 q heads and 2 kv heads of 16
    assert all(row["fp32_ms"] > 0 and row["bf16_ms"] > 0 for row in m["rows"])
    assert m["auto_dtype"] in ("float32", "bfloat16") and set(m["step"]) == {"1", "4"}


def test_matmul_bench_times_the_engines_linear():
    """``bench matmul`` times the engine's own CPU linear (the packed GEMM where the engine uses it),
    which computes x @ W.T: float32 to float rounding, bfloat16 within a bf16 step."""
    import torch.nn.functional as F

    from pagedllm.benchmarks.matmul import engine_linear

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 64, generator=g), torch.randn(5, 64, generator=g)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        y = engine_linear(w.to(dtype))(x.to(dtype))
        ref = F.linear(x.to(dtype).double(), w.to(dtype).double())
        assert y.dtype == dtype and y.shape == (5, 256)
        assert torch.allclose(y.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())
