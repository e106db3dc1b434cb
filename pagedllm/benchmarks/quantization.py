"""int8 (W8A8) against fp32 on one model, in one run: quality, matmul speed, offline throughput.

``--what`` picks any of:

- ``quality``: perplexity of held-out text (the last ``--heldout-fraction`` of ``--text``, cut
  into windows of ``--window`` tokens, at least ``--min-tokens`` scored tokens), computed from
  ``prompt_logprobs`` (token i scored given tokens < i of its window); and the mean position where
  the greedy output of each of 20 chat prompts (plain prompts when the tokenizer has no chat
  template) first differs from fp32 (``--max-tokens`` when it never does). Runs the ``--modes``:
  fp32 first, then e.g. int8 (SmoothQuant, the default), int8-nosmooth (per-token int8 without
  smoothing), int8-g64, int8-head-fp32 (LM head left in float), int8-sq0.7 (SmoothQuant alpha 0.7);
  a mode ending in ``+kv8`` runs with the int8 KV cache (``--kv-cache-dtype int8``), e.g. ``fp32+kv8``.
- ``matmul``: time of ``y = x W^T`` at decode shapes (``--rows`` tokens x the model's linear
  layers): fp32 ``F.linear`` vs the int8 method's ``apply`` (per-token quantization + ``_int_mm``
  + scales) vs ``_int_mm`` alone; the per-token quantization is timed on its own too.
- ``throughput``: ``LLM.generate`` of ``--num-prompts`` token-id prompts at once (ignore_eos),
  fp32 and int8 alternated ``--repeats`` times; output tokens per second.

Timings on a shared machine are noisy: compare ratios taken in the same run.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.benchmarks.common import run_metadata, summarize, write_result
from pagedllm.benchmarks.greedy import first_difference, greedy_outputs
from pagedllm.benchmarks.perplexity import token_nlls
from pagedllm.engine.arg_utils import resolve_model_path
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import QUANTIZATION_METHODS, Int8Config, process_weights_after_loading
from pagedllm.layers.quantization.int8 import int8_mm, quantize_per_token, weight_matrix
from pagedllm.layers.quantization.smoothquant import DEFAULT_SMOOTH_ALPHA
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

MODES = {"fp32": None, "int8": "int8", "int8-g64": "int8-g64"}
QUALITY_MODES = ["fp32", "int8", "int8-nosmooth", "int8-g64"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    p.add_argument("--what", nargs="+", default=["quality"], choices=["quality", "matmul", "throughput"])
    p.add_argument("--text", default="../shared/data/tinyshakespeare.txt", help="held-out text file")
    p.add_argument("--heldout-fraction", type=float, default=0.1, help="score the last fraction of the text")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--min-tokens", type=int, default=2048, help="score at least this many tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per chat prompt")
    p.add_argument("--modes", nargs="+", default=QUALITY_MODES,
                   help="quality: fp32 (always run first), int8, int8-g64, int8-nosmooth, int8-head-fp32, "
                        "int8-sqALPHA; any of them + '+kv8': with the int8 KV cache")
    p.add_argument("--rows", type=int, nargs="+", default=[48, 128, 256], help="matmul: tokens per step")
    p.add_argument("--num-prompts", type=int, default=48, help="throughput: requests at once")
    p.add_argument("--input-len", type=int, default=128, help="throughput: prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="throughput: output tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="throughput: fp32/int8 alternations")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes")
    p.add_argument("--dtype", default="float32", help="activation dtype of every mode (float32: int8 against fp32)")
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def _register_ablation(mode: str) -> str:
    """Register an ablation mode as a quantization name in this process only: ``int8-head-fp32``
    (``int8`` with the LM head left in float), ``int8-nosmooth`` (no SmoothQuant), ``int8-sqALPHA`` (SmoothQuant
    with that alpha). Returns the quantization name (None for fp32)."""
    if mode == "int8-head-fp32":
        QUANTIZATION_METHODS.setdefault(mode, partial(Int8Config, quantize_lm_head=False,
                                                      smooth_alpha=DEFAULT_SMOOTH_ALPHA))
    elif mode == "int8-nosmooth":
        QUANTIZATION_METHODS.setdefault(mode, Int8Config)
    elif mode.startswith("int8-sq"):
        QUANTIZATION_METHODS.setdefault(mode, partial(Int8Config, smooth_alpha=float(mode[len("int8-sq"):])))
    elif mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    return MODES.get(mode, mode)


def _llm(model: Optional[str], quantization: Optional[str], kv: int, dtype: str = "float32", **kw):
    return LLM(model, quantization=quantization, kv_cache_memory=kv, dtype=dtype, **kw)


def heldout_windows(tokenizer, path: str, fraction: float, window: int, min_tokens: int) -> list[list[int]]:
    """Token windows of the last ``fraction`` of the text: enough whole windows for ``min_tokens``
    scored tokens (a window scores window - 1). Raises ValueError when the text is too short."""
    with open(path) as f:
        text = f.read()
    ids = tokenizer.encode(text[int(len(text) * (1 - fraction)):], add_special_tokens=False)
    n = math.ceil(min_tokens / (window - 1))
    if len(ids) < n * window:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than {n} windows of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(n)]


def perplexity(llm, windows: list[list[int]]) -> tuple[float, int]:
    """(perplexity, scored tokens) of every token but the first of each window."""
    nlls = token_nlls(llm, windows)
    return math.exp(sum(nlls) / len(nlls)), len(nlls)


def run_quality(args) -> dict:
    res: dict = {}
    ref_greedy = None
    windows = None
    for mode in ["fp32"] + [m for m in args.modes if m != "fp32"]:
        kv8 = mode.endswith("+kv8")
        quant = _register_ablation(mode.removesuffix("+kv8"))
        llm = _llm(args.model, quant, args.kv_cache_memory, args.dtype, max_num_batched_tokens=args.window,
                   kv_cache_dtype="int8" if kv8 else "auto")
        smoothing = llm.llm_engine.executor.runner.model.quantization_report.smoothing
        if windows is None:
            windows = heldout_windows(llm.get_tokenizer(), args.text, args.heldout_fraction, args.window,
                                      args.min_tokens)
        ppl, count = perplexity(llm, windows)
        greedy = greedy_outputs(llm, args.max_tokens)
        entry = {"perplexity": ppl, "scored_tokens": count, "smoothing": smoothing}
        if ref_greedy is None:
            ref_greedy = greedy
        else:
            firsts = [first_difference(a, b) for a, b in zip(ref_greedy, greedy)]
            entry.update(first_difference=firsts, mean_first_difference=sum(firsts) / len(firsts),
                         identical=sum(f == args.max_tokens for f in firsts),
                         perplexity_vs_fp32=ppl / res["fp32"]["perplexity"] - 1)
        res[mode] = entry
        print(f"{mode:>15}: perplexity {ppl:.4f} over {count} tokens"
              + (f" ({entry['perplexity_vs_fp32'] * 100:+.2f}% vs fp32), greedy first differs at token "
                 f"{entry['mean_first_difference']:.1f} on average ({entry['identical']}/{len(firsts)} "
                 f"identical for {args.max_tokens} tokens)" if mode != "fp32" else "")
              + (f" [{smoothing}]" if smoothing else ""), flush=True)
        del llm
        gc.collect()
    return res


def _time(fn, min_s: float = 0.3) -> float:
    """Median seconds per call over >= 5 calls and >= min_s."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(k, n) of the model's linear layers (TP=1)."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    h = c.hidden_size
    return {"qkv_proj": (h, (c.num_attention_heads + 2 * kv) * head_dim),
            "o_proj": (c.num_attention_heads * head_dim, h), "gate_up_proj": (h, 2 * c.intermediate_size),
            "down_proj": (c.intermediate_size, h), "lm_head": (h, c.vocab_size)}


@torch.inference_mode()
def run_matmul(args) -> dict:
    from transformers import AutoConfig  # lazily: transformers, ~1 s to import

    shapes = linear_shapes(AutoConfig.from_pretrained(resolve_model_path(args.model)))
    rows = []
    for m in args.rows:
        for name, (k, n) in shapes.items():
            x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
            layer = ReplicatedLinear(k, n, quant_config=Int8Config())
            layer.weight.data.copy_(w)
            process_weights_after_loading(layer, Int8Config())
            xq, _ = quantize_per_token(x)
            t_fp32 = _time(lambda: F.linear(x, w))
            t_int8 = _time(lambda: layer(x))
            wq = weight_matrix(layer)
            t_mm = _time(lambda: int8_mm(xq, wq))
            t_q = _time(lambda: quantize_per_token(x))
            ops = 2 * m * k * n
            rows.append({"m": m, "layer": name, "k": k, "n": n, "fp32_ms": t_fp32 * 1e3, "int8_ms": t_int8 * 1e3,
                         "int_mm_ms": t_mm * 1e3, "quantize_ms": t_q * 1e3, "fp32_gflops": ops / t_fp32 / 1e9,
                         "int8_gops": ops / t_int8 / 1e9, "speedup": t_fp32 / t_int8,
                         "quantize_share": t_q / t_int8})
            r = rows[-1]
            print(f"m={m:4d} {name:>12} k={k:5d} n={n:6d}: fp32 {r['fp32_ms']:8.3f} ms ({r['fp32_gflops']:6.1f} "
                  f"GFLOP/s) | int8 {r['int8_ms']:8.3f} ms ({r['int8_gops']:6.1f} GOP/s, {r['speedup']:.2f}x; "
                  f"_int_mm {r['int_mm_ms']:.3f}, per-token quant {r['quantize_ms']:.3f} = "
                  f"{r['quantize_share'] * 100:.0f}%)", flush=True)
    tot_f = sum(r["fp32_ms"] for r in rows)
    tot_q = sum(r["int8_ms"] for r in rows)
    print(f"all shapes: fp32 {tot_f:.2f} ms, int8 {tot_q:.2f} ms ({tot_f / tot_q:.2f}x)")
    return {"rows": rows, "total_fp32_ms": tot_f, "total_int8_ms": tot_q, "speedup": tot_f / tot_q}


def run_throughput(args) -> dict:
    res: dict = {"fp32": [], "int8": []}
    prompts = None
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(args.repeats):
        for mode in ("fp32", "int8"):
            llm = _llm(args.model, MODES[mode], args.kv_cache_memory, args.dtype, max_num_seqs=args.num_prompts)
            if prompts is None:
                vocab = llm.llm_engine.vocab_size
                rng = random.Random(0)
                prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.input_len)]}
                           for _ in range(args.num_prompts)]
            llm.generate([prompts[0]["prompt_token_ids"][:8]], SamplingParams(max_tokens=2), use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            elapsed = time.perf_counter() - start
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            res[mode].append(toks / elapsed)
            print(f"{mode}: {toks} output tokens in {elapsed:.2f} s = {toks / elapsed:.1f} tok/s "
                  f"(+ {args.num_prompts * args.input_len} prompt tokens)", flush=True)
            del llm
            gc.collect()
    best = {m: max(v) for m, v in res.items()}
    print(f"int8 / fp32 (best of {args.repeats} each): {best['int8'] / best['fp32']:.2f}x")
    return {"tok_per_s": res, "best": best, "speedup": best["int8"] / best["fp32"],
            "summary": {m: summarize(v) for m, v in res.items()}}


def run(args: argparse.Namespace) -> dict:
    if "quality" in args.what and not os.path.isfile(args.text):  # before any model loads
        raise SystemExit(f"pagedllm bench quantization: error: no held-out text at {args.text!r} (the default is "
                         f"this project's ../shared/data corpus); pass --text FILE, any plain-text file of a few "
                         f"thousand tokens, or --what matmul throughput")
    result: dict = {"meta": run_metadata(), "model": args.model or "demo", "threads": torch.get_num_threads()}
    if "quality" in args.what:
        result["quality"] = run_quality(args)
    if "matmul" in args.what:
        result["matmul"] = run_matmul(args)
    if "throughput" in args.what:
        result["throughput"] = run_throughput(args)
    write_result(args.output_dir, "quantization", result)
    return result
