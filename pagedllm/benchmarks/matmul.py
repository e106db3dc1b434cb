"""Does bf16 pay on this CPU? Times the model's linear layers at decode shapes in float32 and bfloat16.

For each linear layer of the model (qkv, o, gate_up, down, LM head) and each ``--batch-sizes`` value
(tokens in the step), ``x [B, in] @ W [out, in].T`` is timed in both dtypes through the engine's own
CPU linear (``UnquantizedLinearMethod``: the weight packed once for ``float_gemm_cpu``, or for
oneDNN, or plain ``F.linear``, whichever the engine would run; on an AVX2 CPU bf16 runs our GEMM on
widened values, where ``F.linear`` emulates it at a fraction of fp32's speed), interleaved in the
same run (fp32 rep, bf16 rep, ...) so that machine load hits both alike; each figure is the
minimum over ``--reps`` repetitions. Reports the fp32/bf16 time ratio per shape and for a whole
decode step (the sum of the layers times ``num_hidden_layers``, plus the LM head), next to what
``--dtype auto`` picks here (``pagedllm.engine.arg_utils.resolve_dtype``: bf16 where the CPU has native bf16
matmuls). A ratio above 1 means bf16 is faster.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pagedllm.benchmarks.common import pyplot, run_metadata, stamp, write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.engine.arg_utils import resolve_dtype, resolve_model_path
from pagedllm.platforms.cpu.cpu_info import cpu_has_native_bf16
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, or shape:NAME; default: the demo model")
    p.add_argument("--batch-sizes", default="1,16,48", help="comma-separated tokens per step")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per shape and dtype (minimum kept)")
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def linear_shapes(hf_config) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, times per step) of a Llama-family decoder's linears."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    q = c.num_attention_heads * head_dim
    n = c.num_hidden_layers
    return {"qkv_proj": (c.hidden_size, q + 2 * kv * head_dim, n), "o_proj": (q, c.hidden_size, n),
            "gate_up_proj": (c.hidden_size, 2 * c.intermediate_size, n), "down_proj": (c.intermediate_size, c.hidden_size, n),
            "lm_head": (c.hidden_size, c.vocab_size, 1)}


def _min_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def engine_linear(w: torch.Tensor):
    """x [B, in] -> x @ w.T through the engine's CPU linear layer on w [out, in] (packed as the
    engine packs it after loading)."""
    layer, method = nn.Module(), UnquantizedLinearMethod()
    method.create_weights(layer, w.shape[1], w.shape[0], False, w.dtype)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    return lambda x: method.apply(layer, x)


def time_linear(batch: int, d_in: int, d_out: int, reps: int) -> dict[str, float]:
    """Seconds of one engine linear (``engine_linear``) in float32 and bfloat16 (minimum over
    ``reps``, interleaved)."""
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    x32 = torch.randn(batch, d_in, generator=g)
    w16, x16 = w32.bfloat16(), x32.bfloat16()
    lin32, lin16 = engine_linear(w32), engine_linear(w16)
    fns = {"float32": lambda: lin32(x32), "bfloat16": lambda: lin16(x16)}
    for fn in fns.values():  # warm-up (oneDNN primitive creation)
        fn(), fn()
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            best[k] = min(best[k], _min_time(fn, 1))
    return best


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig  # lazily: transformers, ~1 s to import

    model, _ = resolve_model(args.model, "auto", args.output_dir)
    hf_config = AutoConfig.from_pretrained(resolve_model_path(model))
    auto_dtype, why = resolve_dtype("auto", hf_config, "cpu")
    shapes = linear_shapes(hf_config)
    rows, steps = [], {}
    with torch.inference_mode():
        for b in (int(x) for x in args.batch_sizes.split(",")):
            step = {"float32": 0.0, "bfloat16": 0.0}
            for name, (d_in, d_out, times) in shapes.items():
                t = time_linear(b, d_in, d_out, args.reps)
                rows.append({"batch": b, "layer": name, "in": d_in, "out": d_out, "fp32_ms": t["float32"] * 1e3,
                             "bf16_ms": t["bfloat16"] * 1e3, "fp32_over_bf16": t["float32"] / t["bfloat16"]})
                for k in step:
                    step[k] += t[k] * times
            steps[b] = {"fp32_ms": step["float32"] * 1e3, "bf16_ms": step["bfloat16"] * 1e3,
                        "fp32_over_bf16": step["float32"] / step["bfloat16"]}
    print(f"native bf16 matmuls: {cpu_has_native_bf16()}; --dtype auto on this CPU: "
          f"{str(auto_dtype).replace('torch.', '')} ({why}); threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'layer':12} {'in':>6} {'out':>6} {'fp32 ms':>9} {'bf16 ms':>9} {'fp32/bf16':>9}")
    for r in rows:
        print(f"{r['batch']:5d} {r['layer']:12} {r['in']:6d} {r['out']:6d} {r['fp32_ms']:9.3f} {r['bf16_ms']:9.3f} "
              f"{r['fp32_over_bf16']:9.2f}")
    for b, s in steps.items():
        print(f"decode step of {b} tokens, all linears: fp32 {s['fp32_ms']:.1f} ms, bf16 {s['bf16_ms']:.1f} ms, "
              f"fp32/bf16 {s['fp32_over_bf16']:.2f}")
    result = {**run_metadata(), "bench": "matmul", "model": model, "native_bf16": cpu_has_native_bf16(),
              "auto_dtype": str(auto_dtype).replace("torch.", ""), "auto_reason": why,
              "threads": torch.get_num_threads(), "reps": args.reps, "rows": rows,
              "step": {str(b): s for b, s in steps.items()}}
    write_result(args.output_dir, f"matmul-{stamp()}", result, _plot(rows, model))
    return result


def _plot(rows: list[dict], model):
    plt = pyplot()
    if plt is None:
        return None
    batches = sorted({r["batch"] for r in rows})
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        ratios = [next(r["fp32_over_bf16"] for r in rows if r["batch"] == b and r["layer"] == n) for n in layers]
        ax.bar([j + i * width for j in range(len(layers))], ratios, width, label=f"{b} tokens")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))], layers)
    ax.set_ylabel("fp32 time / bf16 time")
    ax.set_title(f"{model or 'demo model'}: the engine's linear at decode shapes (> 1: bf16 faster)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig
