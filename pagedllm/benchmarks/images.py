"""Image workload: N requests, each one ``--image-size`` x ``--image-size`` image and a short question,
through the offline engine; TTFT and throughput with the encoder cache cold vs warm.

Both modes answer the same "second turn" prompts (each request's image again, behind another question,
prefix caching off so that only the encoder cache can help): ``cold`` in a fresh engine (every image
encoded), ``warm`` in an engine that has just answered the first turn (every image's embeddings in the
encoder cache: no encoder time). Reports TTFT (mean / median / p99), output and total throughput,
encoder-cache queries and hits, and whether both modes gave the same ids. Images are seeded random
pictures; the default model is a Qwen2-VL-2B-shaped config with random weights (``--load-format dummy``).

    pagedllm bench images --model shape:qwen2-vl-2b --num-prompts 8 --image-size 448
"""
from __future__ import annotations

import argparse
import gc
import random
import time

import numpy as np

from pagedllm.benchmarks.common import pyplot, run_metadata, summarize, write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.engine.arg_utils import resolve_model_path
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

_QUESTION_WORDS = "what is in this picture describe the colors shapes and where they are please".split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="shape:qwen2-vl-2b", help="an image-text model folder, or shape:NAME "
                   "(qwen2-vl-2b, qwen2-vl-tiny: random weights)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--image-size", type=int, default=448, help="pixels a side of each image")
    p.add_argument("--question-len", type=int, default=8, help="words of each question")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def _images(args) -> list:
    """One seeded random picture per request (noise: no two alike, so no two share a cache entry)."""
    from PIL import Image  # lazily: pillow, only for this bench

    rng = np.random.default_rng(args.seed)
    s = args.image_size
    return [Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8)) for _ in range(args.num_prompts)]


def _prompts(args, placeholder: str, images: list, turn: int) -> list[dict]:
    rng = random.Random(args.seed * 1000 + turn)
    return [{"prompt": f"{placeholder} " + " ".join(rng.choice(_QUESTION_WORDS) for _ in range(args.question_len)),
             "multi_modal_data": {"image": img}} for img in images]


def _measure(llm: LLM, prompts: list[dict], output_len: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = llm.llm_engine.get_stats()
    q0, h0 = getattr(before, "mm_cache_queries", 0), getattr(before, "mm_cache_hits", 0)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_throughput_tok_s": out_tokens / elapsed,
            "total_throughput_tok_s": (in_tokens + out_tokens) / elapsed, "requests_per_s": len(prompts) / elapsed,
            "prompt_tokens_per_request": in_tokens / len(prompts), "ttft_ms": summarize([o.metrics.ttft for o in outs],
                                                                                        1000.0),
            "encoder_cache_queries": stats.mm_cache_queries - q0, "encoder_cache_hits": stats.mm_cache_hits - h0,
            "output_token_ids": [o.outputs[0].token_ids for o in outs]}


def run(args: argparse.Namespace) -> dict:
    model_path, load_format = resolve_model(args.model, args.load_format, args.output_dir)
    model_path = resolve_model_path(model_path)
    images = _images(args)
    kw = dict(load_format=load_format, kv_cache_memory=args.kv_cache_memory, seed=args.seed,
              max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              limit_mm_per_prompt={"image": 1})
    modes = {}
    for mode in ("cold", "warm"):
        llm = LLM(model_path, **kw)
        mark = llm.llm_engine.mm_processor.placeholder
        if mode == "warm":  # the first turn: every image encoded and kept
            _measure(llm, _prompts(args, mark, images, turn=1), args.output_len)
        modes[mode] = _measure(llm, _prompts(args, mark, images, turn=2), args.output_len)
        llm.llm_engine.shutdown()
        del llm
        gc.collect()  # (one engine's weights at a time: a 2B model's are 7 GiB in float32)
    cold, warm = modes["cold"], modes["warm"]
    same = cold.pop("output_token_ids") == warm.pop("output_token_ids")
    result = {**run_metadata(), "bench": "images", "model": args.model, "num_prompts": args.num_prompts,
              "image_size": args.image_size, "output_len": args.output_len, "encoder_cache_cold": cold,
              "encoder_cache_warm": warm, "outputs_identical": same,
              "ttft_speedup_mean": cold["ttft_ms"]["mean"] / warm["ttft_ms"]["mean"],
              "throughput_ratio": warm["total_throughput_tok_s"] / cold["total_throughput_tok_s"]}
    print(f"{args.num_prompts} requests, one {args.image_size}x{args.image_size} image each "
          f"({cold['prompt_tokens_per_request']:.0f} prompt tokens): encoder cache cold: TTFT mean "
          f"{cold['ttft_ms']['mean']:.0f} ms, {cold['total_throughput_tok_s']:.1f} tok/s | warm: TTFT mean "
          f"{warm['ttft_ms']['mean']:.0f} ms, {warm['total_throughput_tok_s']:.1f} tok/s, hits "
          f"{warm['encoder_cache_hits']}/{warm['encoder_cache_queries']} | TTFT {result['ttft_speedup_mean']:.2f}x "
          f"faster, throughput {result['throughput_ratio']:.2f}x, outputs identical: {same}")
    plt = pyplot()
    fig = None
    if plt is not None:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        ax[0].bar(["cold", "warm"], [cold["ttft_ms"]["mean"], warm["ttft_ms"]["mean"]], color=["grey", "tab:blue"])
        ax[0].set_title("mean TTFT (ms)")
        ax[1].bar(["cold", "warm"], [cold["total_throughput_tok_s"], warm["total_throughput_tok_s"]],
                  color=["grey", "tab:blue"])
        ax[1].set_title("total throughput (tok/s)")
        fig.suptitle(f"{args.num_prompts} requests with a {args.image_size}-pixel image: encoder cache cold vs warm")
    write_result(args.output_dir, "images", result, fig)
    return result
