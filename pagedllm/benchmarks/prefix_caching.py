"""Shared-prefix workload: one long system prompt, many short questions; prefix caching on vs off.

Each mode runs in a fresh engine on the same seeded prompts (token ids: a ``--prefix-len``-token
system prompt, then ``--question-len`` question tokens, uniform +-50 %), all submitted at once
(``--arrival all``) or one after another (``--arrival sequential``: TTFT without queueing).
Reports TTFT (mean / median / p99), output and total throughput, and prefix-cache hit rate.

    pagedllm bench prefix-caching --model shape:qwen2-0.5b --num-prompts 16 --prefix-len 1000
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import describe_on_off, on_off_ratios, pyplot, run_metadata, summarize, write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.engine.arg_utils import resolve_model_path
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder, shape:NAME, or none for the demo model")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=24, help="mean tokens of each question")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--arrival", choices=["all", "sequential"], default="all")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def _workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab) for _ in range(args.prefix_len)]
    lo, hi = max(1, args.question_len // 2), max(1, args.question_len * 3 // 2)
    return [system + [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_prompts)]


def _run_mode(args, model_path: str, load_format: str, prompts: list[list[int]], caching: bool) -> dict:
    llm = LLM(model_path, load_format=load_format, kv_cache_memory=args.kv_cache_memory, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, unrelated prefix
    start = time.perf_counter()
    if args.arrival == "all":
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(map(len, prompts))
    result = {
        "enable_prefix_caching": caching,
        "elapsed_s": elapsed,
        "output_throughput_tok_s": out_tokens / elapsed,
        "total_throughput_tok_s": (in_tokens + out_tokens) / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "ttft_ms": summarize([o.metrics.ttft for o in outs], 1000.0),
        "cached_tokens_per_request": [o.num_cached_tokens for o in outs],
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "output_token_ids": [o.outputs[0].token_ids for o in outs],
    }
    llm.llm_engine.shutdown()
    return result


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig  # lazily: transformers, ~1 s to import

    model_path, load_format = resolve_model(args.model, args.load_format, args.output_dir)
    model_path = resolve_model_path(model_path)
    prompts = _workload(args, AutoConfig.from_pretrained(model_path).vocab_size)
    off = _run_mode(args, model_path, load_format, prompts, caching=False)
    on = _run_mode(args, model_path, load_format, prompts, caching=True)
    same = on.pop("output_token_ids") == off.pop("output_token_ids")
    result = {**run_metadata(), "bench": "prefix-caching", "num_prompts": len(prompts),
              "prefix_len": args.prefix_len, "question_len": args.question_len, "output_len": args.output_len,
              "arrival": args.arrival, "caching_off": off, "caching_on": on, "outputs_identical": same}
    result.update(on_off_ratios(off, on))
    print(describe_on_off("prefix caching", off, on, result,
                          f", hit rate {on['prefix_cache_hits'] / max(1, on['prefix_cache_queries']):.1%}, "
                          f"outputs identical: {same}"))
    plt = pyplot()
    fig = None
    if plt is not None:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        ax[0].bar(["off", "on"], [off["ttft_ms"]["mean"], on["ttft_ms"]["mean"]], color=["grey", "tab:blue"])
        ax[0].set_title("mean TTFT (ms)")
        ax[1].bar(["off", "on"], [off["total_throughput_tok_s"], on["total_throughput_tok_s"]],
                  color=["grey", "tab:blue"])
        ax[1].set_title("total throughput (tok/s)")
        fig.suptitle(f"{len(prompts)} requests sharing a {args.prefix_len}-token prefix ({args.arrival})")
    write_result(args.output_dir, "prefix_caching", result, fig)
    return result
