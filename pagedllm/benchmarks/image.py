"""Image workload: N requests, each a short question followed by one image (a random 448x448 picture
by default) and the model's image placeholder; the encoder cache on vs off.

The same image goes with every question (the question comes first, so the prefix cache cannot cover
the image's tokens): with the encoder cache on, the image is encoded once and each later request takes
its embeddings from the cache; off (the cache holds nothing: capacity 0), every request encodes it.
``--distinct-images`` gives each request its own image instead (every request a miss either way: the
encoder's full cost). Each mode runs in a fresh engine on the same prompts, all submitted at once
(``--arrival all``) or one after another (``--arrival sequential``: TTFT without queueing). Reports
TTFT (mean / median / p99), throughput, the encoder-cache queries and hits, and whether both modes
gave the same tokens.

    pagedllm bench image --model /path/to/llava-or-gemma3 --num-prompts 16
    pagedllm bench image --model shape:qwen2-vl-2b --max-model-len 2048   (random weights of that shape)
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import describe_on_off, on_off_ratios, run_metadata, summarize, write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.engine.arg_utils import resolve_model_path
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

_WORDS = "what is in this picture describe the colors shapes count objects left right top".split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an image-text model folder (LLaVA, Gemma 3, Qwen2-VL, ...), or "
                   "shape:qwen2-vl-2b / shape:qwen2-vl-tiny (random weights of that shape)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--image-size", type=int, default=448, help="width and height of each picture (pixels)")
    p.add_argument("--distinct-images", action="store_true", help="a different picture per request")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--arrival", choices=["all", "sequential"], default="all")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def _picture(seed: int, size: int):
    from PIL import Image, ImageDraw  # lazily: Pillow, only for this bench

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.randrange(size), rng.randrange(size)
        box = [x, y, x + rng.randrange(size // 16, size // 3), y + rng.randrange(size // 16, size // 3)]
        draw.rectangle(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def _workload(args, placeholder: str) -> list[dict]:
    rng = random.Random(args.seed)
    shared = _picture(args.seed, args.image_size)
    return [{"prompt": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 10))) + " " + placeholder,
             "multi_modal_data": {"image": _picture(args.seed + 1 + i, args.image_size)
                                  if args.distinct_images else shared}}
            for i in range(args.num_prompts)]


def _run_mode(args, model_path: str, load_format: str, cache: bool) -> dict:
    llm = LLM(model_path, load_format=load_format, kv_cache_memory=args.kv_cache_memory, seed=args.seed,
              max_model_len=args.max_model_len)
    engine = llm.llm_engine
    if engine.mm_processor is None:
        raise ValueError(f"{model_path} takes no images: pass an image-text model (LLaVA, Gemma 3)")
    if not cache:
        engine.input_batch.encoder_cache.capacity = 0  # every image evicts the others: nothing is kept
    prompts = _workload(args, engine.mm_processor.placeholder)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
    before = engine.get_stats()
    start = time.perf_counter()
    if args.arrival == "all":
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        outs = [llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = {"encoder_cache": cache, "elapsed_s": elapsed, "output_throughput_tok_s": out_tokens / elapsed,
              "total_throughput_tok_s": (in_tokens + out_tokens) / elapsed, "requests_per_s": len(outs) / elapsed,
              "ttft_ms": summarize([o.metrics.ttft for o in outs], 1000.0),
              "mm_cache_queries": stats.mm_cache_queries - before.mm_cache_queries,
              "mm_cache_hits": stats.mm_cache_hits - before.mm_cache_hits,
              "prompt_tokens_mean": in_tokens / len(outs), "output_token_ids": [o.outputs[0].token_ids for o in outs]}
    engine.shutdown()
    return result


def run(args: argparse.Namespace) -> dict:
    model_path, load_format = resolve_model(args.model, args.load_format, args.output_dir)
    model_path = resolve_model_path(model_path)
    off = _run_mode(args, model_path, load_format, cache=False)
    on = _run_mode(args, model_path, load_format, cache=True)
    same = on.pop("output_token_ids") == off.pop("output_token_ids")
    result = {**run_metadata(), "bench": "image", "num_prompts": args.num_prompts, "image_size": args.image_size,
              "distinct_images": args.distinct_images, "output_len": args.output_len, "arrival": args.arrival,
              "cache_off": off, "cache_on": on, "outputs_identical": same}
    result.update(on_off_ratios(off, on))
    print(describe_on_off("encoder cache", off, on, result, f", hits off {off['mm_cache_hits']}/"
                          f"{off['mm_cache_queries']}, on {on['mm_cache_hits']}/{on['mm_cache_queries']}, "
                          f"outputs identical: {same}"))
    write_result(args.output_dir, "image", result)
    return result
