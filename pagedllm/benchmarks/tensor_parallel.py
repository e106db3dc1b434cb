"""Tensor-parallel throughput: the same workload at ``tensor_parallel_size`` 1 and N, and the
communication share of a step on rank 0.

    python -m pagedllm.benchmarks.tensor_parallel --model shape:qwen2-0.5b --tp 1 2

Each size runs in a fresh process (one process group per process). Prompts are random token ids
and every request generates exactly ``--output-len`` tokens (greedy, no EOS). Timings exclude
loading and a warm-up request. Rank 0's time inside all-reduce/all-gather (which includes waiting
for the slower rank) and inside the per-step broadcast of the batch is reported as a share of
the time spent in the executor, separately for steps with prefill tokens and pure decode steps.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import pagedllm.layers.fused_moe as fused_moe
import pagedllm.layers.quantization.base as qbase
import pagedllm.layers.quantization.int8 as qint8
import pagedllm.layers.vocab_embedding as vocab
import pagedllm.worker.multiproc_executor as mpx
from pagedllm.benchmarks.common import write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams


def _timed(fn: Callable, stats: dict, key: str) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[key] += time.perf_counter() - t
    return wrapper


def run_one(a: argparse.Namespace) -> dict:
    """One tensor-parallel size, in this process."""
    comm: dict[str, float] = defaultdict(float)
    # The layers imported the collectives by name: wrap them where they are called (rank 0 only).
    for mod in (qbase, qint8, fused_moe):  # the linear methods and the MoE block reduce their outputs
        mod.tensor_model_parallel_all_reduce = _timed(mod.tensor_model_parallel_all_reduce, comm, "collective")
    vocab.tensor_model_parallel_all_reduce = _timed(vocab.tensor_model_parallel_all_reduce, comm, "collective")
    vocab.tensor_model_parallel_all_gather = _timed(vocab.tensor_model_parallel_all_gather, comm, "collective")
    mpx.broadcast_object = _timed(mpx.broadcast_object, comm, "broadcast")  # the driver's per-step call

    model, load_format = resolve_model(a.model, a.load_format, a.output_dir)
    llm = LLM(model, load_format=load_format, tensor_parallel_size=a.tp_one, kv_cache_memory=a.kv_cache_memory,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.input_len + a.output_len,
              dtype=a.dtype)
    engine = llm.llm_engine
    vocab_size = engine.model_config.hf_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)

    per_kind: dict[str, dict[str, float]] = {k: defaultdict(float) for k in ("prefill", "decode")}
    executor = engine.executor
    inner = executor.execute_model

    def execute_model(model_input):
        kind = "decode" if model_input.attn_metadata.num_decode_tokens == len(model_input.input_ids) else "prefill"
        before = dict(comm)
        t = time.perf_counter()
        out = inner(model_input)
        s = per_kind[kind]
        s["steps"] += 1
        s["total"] += time.perf_counter() - t
        for k in ("collective", "broadcast"):
            s[k] += comm.get(k, 0.0) - before.get(k, 0.0)
        return out

    executor.execute_model = execute_model
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    engine.shutdown()
    return {
        "tensor_parallel_size": a.tp_one,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + a.num_prompts * a.input_len) / elapsed,
        "steps": {k: {"steps": int(v["steps"]), "executor_s": v["total"], "collective_s": v["collective"],
                      "broadcast_s": v["broadcast"],
                      "comm_share": (v["collective"] + v["broadcast"]) / v["total"] if v["total"] else 0.0}
                  for k, v in per_kind.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape:qwen2-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes per rank")
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--tp-one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one size, here
    a = p.parse_args(argv)
    if a.tp_one is not None:
        print("RESULT " + json.dumps(run_one(a)), flush=True)
        return
    results = []
    for tp in a.tp:
        args = [a2 for a2 in (argv if argv is not None else sys.argv[1:])]
        cmd = [sys.executable, "-m", "pagedllm.benchmarks.tensor_parallel", *args, "--tp-one", str(tp)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, env=os.environ.copy()).stdout
        res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        results.append(res)
        s = res["steps"]
        print(f"tp={tp}: {res['output_tokens_per_s']:.1f} output tok/s, {res['total_tokens_per_s']:.1f} total tok/s "
              f"({res['elapsed_s']:.1f} s); comm share: prefill steps {100 * s['prefill']['comm_share']:.1f}% "
              f"(broadcast {1000 * s['prefill']['broadcast_s'] / max(1, s['prefill']['steps']):.2f} ms/step), "
              f"decode steps {100 * s['decode']['comm_share']:.1f}% "
              f"(broadcast {1000 * s['decode']['broadcast_s'] / max(1, s['decode']['steps']):.2f} ms/step)",
              flush=True)
    base = results[0]["output_tokens_per_s"]
    for r in results[1:]:
        print(f"throughput tp={r['tensor_parallel_size']} / tp={results[0]['tensor_parallel_size']}: "
              f"{r['output_tokens_per_s'] / base:.2f}x")
    write_result(a.output_dir, "tensor_parallel", {"args": {k: v for k, v in vars(a).items() if k != "tp_one"},
                                          "results": results})


if __name__ == "__main__":
    main()
