"""One workload, four ways to use the machine: one process (all cores), tensor parallel,
pipeline parallel, data parallel (replicas). Each runs in a fresh process, in one invocation.

    python -m pagedllm.benchmarks.parallel --model shape:qwen2-0.5b --configs one tp2 pp2 dp2

Configs: ``one`` = one engine with ``cores`` torch threads; ``tpN`` / ``ppN`` = N ranks, cores / N
threads each (``ppN`` with up to N batches in flight, ``ppNsync`` with one: each batch through
every stage before the next); ``dpN`` = N replicas (``DPAsyncLLM``), cores / N threads each.
Prompts are random token ids; every request generates exactly ``--output-len`` tokens (greedy, no
EOS). Timings exclude loading and a warm-up request. For TP and PP, rank 0's time in communication
is reported as a share of its time in the executor: TP = its all-reduces / all-gathers (including
waiting for the slower rank) plus the per-step broadcast of the batch; PP = the broadcast plus
sending the hidden states to stage 1 and waiting for the logits from the last stage (which
includes the other stages' compute not overlapped with rank 0's own: the pipeline bubble).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict

import pagedllm.layers.fused_moe as fused_moe
import pagedllm.layers.quantization.base as qbase
import pagedllm.layers.quantization.int8 as qint8
import pagedllm.layers.vocab_embedding as vocab
import pagedllm.worker.multiproc_executor as mpx
import pagedllm.worker.pp_runner as pp_runner
from pagedllm.benchmarks.common import write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.benchmarks.tensor_parallel import _timed
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.dp_client import DPAsyncLLM
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams


def _workload(a: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size) for _ in range(a.input_len)] for _ in range(a.num_prompts)]


def _engine_kwargs(a: argparse.Namespace, model: str, load_format: str) -> dict:
    return dict(model=model, load_format=load_format, kv_cache_memory=a.kv_cache_memory,
                max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.input_len + a.output_len,
                dtype=a.dtype)


def run_model_parallel(a: argparse.Namespace, tp: int, pp: int, pp_sync: bool = False) -> dict:
    comm: dict[str, float] = defaultdict(float)
    for mod in (qbase, qint8, fused_moe):  # the linear methods and the MoE block reduce their outputs
        mod.tensor_model_parallel_all_reduce = _timed(mod.tensor_model_parallel_all_reduce, comm, "comm")
    vocab.tensor_model_parallel_all_reduce = _timed(vocab.tensor_model_parallel_all_reduce, comm, "comm")
    vocab.tensor_model_parallel_all_gather = _timed(vocab.tensor_model_parallel_all_gather, comm, "comm")
    pp_runner.pp_send = _timed(pp_runner.pp_send, comm, "comm")
    pp_runner.PendingLogits.wait = _timed(pp_runner.PendingLogits.wait, comm, "comm")  # rank 0's logits
    mpx.broadcast_object = _timed(mpx.broadcast_object, comm, "comm")
    mpx.broadcast_object_async = _timed(mpx.broadcast_object_async, comm, "comm")

    model, load_format = resolve_model(a.model, a.load_format, a.output_dir)
    kw = _engine_kwargs(a, model, load_format)
    llm = LLM(kw.pop("model"), tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)
    engine = llm.llm_engine
    if pp_sync:
        engine.pipeline_depth = 1
    prompts = _workload(a, engine.model_config.hf_config.vocab_size)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    executor, stats = engine.executor, defaultdict(float)
    inner = executor.execute_model

    def execute_model(model_input):
        before, t = comm["comm"], time.perf_counter()
        out = inner(model_input)
        stats["executor_s"] += time.perf_counter() - t
        stats["comm_s"] += comm["comm"] - before
        return out

    def execute_model_async(model_input):
        before, t = comm["comm"], time.perf_counter()
        future = inner_async(model_input)
        stats["executor_s"] += time.perf_counter() - t
        stats["comm_s"] += comm["comm"] - before
        result = future.result

        def timed_result():
            before, t = comm["comm"], time.perf_counter()
            out = result()
            stats["executor_s"] += time.perf_counter() - t
            stats["comm_s"] += comm["comm"] - before
            return out

        future.result = timed_result
        return future

    inner_async = executor.execute_model_async
    executor.execute_model = execute_model
    executor.execute_model_async = execute_model_async
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - t
    engine.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens_per_s": n_out / elapsed,
            "comm_share": stats["comm_s"] / stats["executor_s"] if stats["executor_s"] else 0.0,
            "max_inflight_batches": engine.max_inflight_batches, **stats}


def run_data_parallel(a: argparse.Namespace, dp: int) -> dict:
    model, load_format = resolve_model(a.model, a.load_format, a.output_dir)
    kw = _engine_kwargs(a, model, load_format)
    llm = DPAsyncLLM(EngineArgs(**kw), dp).start()
    prompts = _workload(a, llm.engine.vocab_size)

    async def generate_all(ps, max_tokens):
        async def one(i, p):
            last = None
            async for out in llm.generate({"prompt_token_ids": p}, SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True), f"r{max_tokens}-{i}"):
                last = out
            return last
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))

    try:
        asyncio.run(generate_all([prompts[0][:8]] * dp, 2))  # warm up every replica
        t = time.perf_counter()
        outs = asyncio.run(generate_all(prompts, a.output_len))
        elapsed = time.perf_counter() - t
        per_replica = [r.requests_routed for r in llm.replicas]
    finally:
        llm.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens_per_s": n_out / elapsed, "requests_per_replica": per_replica}


def run_config(a: argparse.Namespace, name: str) -> dict:
    sync = name.endswith("sync")
    kind, n = (name, 1) if name == "one" else (name[:2], int(name[2:len(name) - 4 * sync]))
    if kind == "dp":
        res = run_data_parallel(a, n)
    else:
        res = run_model_parallel(a, n if kind == "tp" else 1, n if kind == "pp" else 1, pp_sync=sync)
    return {"config": name, **res}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape:qwen2-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", nargs="+", default=["one", "tp2", "pp2", "dp2"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes per rank / replica")
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one config, here
    a = p.parse_args(argv)
    if a.one is not None:
        print("RESULT " + json.dumps(run_config(a, a.one)), flush=True)
        return
    results = []
    for name in a.configs:
        args = list(argv if argv is not None else sys.argv[1:])
        load = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "pagedllm.benchmarks.parallel", *args, "--one", name]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, env=os.environ.copy()).stdout
        res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        res["loadavg_1min_before"] = load
        results.append(res)
        extra = (f"comm share {100 * res['comm_share']:.1f}%" if "comm_share" in res
                 else f"requests per replica {res['requests_per_replica']}")
        print(f"{name}: {res['output_tokens_per_s']:.2f} output tok/s ({res['elapsed_s']:.1f} s), {extra}, "
              f"load avg before {load:.1f}", flush=True)
    write_result(a.output_dir, "parallel", {"args": {k: v for k, v in vars(a).items() if k != "one"},
                                          "results": results})


if __name__ == "__main__":
    main()
