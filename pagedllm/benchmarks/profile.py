"""Where the time of one decode step goes.

``--batch-size`` requests with ``--context-len``-token prompts are prefilled, then every step is a
pure decode step of the whole batch. Over ``--steps`` decode steps the bench reports:

1. the wall time of a step without any instrumentation (on a CPU with the layer runner, all
   decoder layers in one C call, where it applies; then also with the Python layer loop, which the
   breakdown below times); with the runner, also its layers' phases (qkv_proj, attention, ...) as
   the runner times them between its kernel calls, and the rest of its step;
2. a breakdown from timing hooks (``time.perf_counter`` around each part; CPU ops are
   synchronous, on CUDA the hooks synchronize): engine parts (schedule, prepare_inputs, sampler,
   update, detokenize/outputs) and, inside the forward pass, each linear layer, paged attention
   (K/V write + gather + SDPA), rotary, RMSNorm, the SwiGLU activation, the LM head, and the rest
   (residual adds, reshapes, Python between ops);
3. a ``torch.profiler`` table of the top operators by self time, and the share of the step spent
   outside any ATen operator or pagedllm:: kernel (Python and framework overhead);
4. the step's FLOPs and bytes (weights + K/V read) against this machine's measured square-GEMM
   FLOP/s and read bandwidth: the floor the step could reach (the larger of the two), and the
   floor per phase (the linear layers and attention each at their own bound, summed: they run
   one after the other, so attention's memory time cannot hide behind the matmuls).
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm.benchmarks.common import pyplot, run_metadata, stamp, wrap_engine_parts, write_result
from pagedllm.benchmarks.matmul import engine_linear
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.attention.selector import CHOICES
from pagedllm.layers.linear import LinearBase
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, or shape:qwen2-0.5b; default: the demo model")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. int8 (see pagedllm serve --help)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoding together")
    p.add_argument("--context-len", type=int, default=256, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=5, help="decode steps measured (per method)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention-backend", default="auto", choices=CHOICES)
    p.add_argument("--no-torch-profiler", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


class Timers:
    def __init__(self, sync: Callable[[], None]) -> None:
        self.total: dict[str, float] = defaultdict(float)
        # name -> timings open: a call inside another of the same name (a norm's fused method calling
        # its forward) is not counted twice
        self.active: dict[str, int] = defaultdict(int)
        self.sync = sync
        self.enabled = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            if not self.enabled or self.active[name]:
                return fn(*a, **kw)
            self.sync()
            t = time.perf_counter()
            self.active[name] += 1
            try:
                return fn(*a, **kw)
            finally:
                self.active[name] -= 1
                self.sync()
                self.total[name] += time.perf_counter() - t
        return timed

    def hook_module(self, name: str, module: torch.nn.Module) -> None:
        starts: list[Optional[float]] = []

        def pre(_m, _inp):
            if self.enabled:
                if self.active[name]:
                    starts.append(None)
                    return
                self.sync()
                starts.append(time.perf_counter())
                self.active[name] += 1

        def post(_m, _inp, _out):
            if self.enabled and starts:
                t = starts.pop()
                if t is not None:
                    self.active[name] -= 1
                    self.sync()
                    self.total[name] += time.perf_counter() - t

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def instrument(engine, timers: Timers) -> None:
    """Wrap the engine's parts and hook the model's modules (no core file is changed)."""
    wrap_engine_parts(engine, timers.wrap, {
        "schedule": "engine: schedule", "update_requests": "engine: update requests",
        "prepare_inputs": "engine: prepare_inputs", "sample": "sampler", "detokenize": "engine: detokenize + outputs",
        "make_outputs": "engine: detokenize + outputs", "forward": "forward total"})
    model = engine.executor.runner.model
    model.compute_logits = timers.wrap("lm_head (logits)", model.compute_logits)
    timers.hook_module("model body", model)
    backends = {}
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _LINEARS:
            timers.hook_module(f"linear: {leaf}", m)
        elif leaf == "embed_tokens":
            timers.hook_module("embedding", m)
        elif leaf.endswith("norm"):
            # the q/k norms run inside self_attn; the rest between the blocks. Their fused methods
            # (in place on q/k; Gemma's post-norm add + next norm) bypass the forward hooks.
            name = "q/k norms" if leaf in ("q_norm", "k_norm") else "rmsnorm"
            timers.hook_module(name, m)
            for meth in ("forward_heads_", "add_to_"):
                if hasattr(m, meth):
                    setattr(m, meth, timers.wrap(name, getattr(m, meth)))
        elif leaf == "rotary_emb":
            timers.hook_module("rotary", m)
        elif leaf == "mlp":
            timers.hook_module("_mlp", m)
        elif leaf == "self_attn":
            timers.hook_module("_self_attn", m)
            backends[id(m.backend)] = m.backend
    for b in backends.values():
        b.forward = timers.wrap("attention (paged: KV write, gather, SDPA)", b.forward)


def breakdown(total: dict[str, float], steps: int) -> dict[str, float]:
    """Per-step seconds of disjoint parts (derived ones: activation, attention glue, forward rest)."""
    t = {k: v / steps for k, v in total.items()}
    out = {k: v for k, v in t.items() if not k.startswith("_") and k not in ("forward total", "model body")}
    linear_mlp = t.get("linear: gate_up_proj", 0) + t.get("linear: down_proj", 0)
    out["activation (act(gate) * up)"] = max(0.0, t.get("_mlp", 0) - linear_mlp)
    attn_parts = t.get("linear: qkv_proj", 0) + t.get("linear: o_proj", 0) + t.get("rotary", 0) + \
        t.get("attention (paged: KV write, gather, SDPA)", 0) + t.get("q/k norms", 0)
    out["attention glue (split, views)"] = max(0.0, t.get("_self_attn", 0) - attn_parts)
    inside_body = t.get("embedding", 0) + t.get("_self_attn", 0) + t.get("_mlp", 0) + t.get("rmsnorm", 0)
    out["forward rest (residual adds, Python)"] = max(0.0, t.get("model body", 0) - inside_body)
    out["runner rest (logits gather)"] = max(0.0, t.get("forward total", 0) - t.get("model body", 0)
                                             - t.get("lm_head (logits)", 0))
    return out


def machine_peaks(dtype: torch.dtype, trials: int = 5) -> dict[str, float]:
    """Measured matmul FLOP/s (a decode-shaped and a square GEMM) and memory read bandwidth, each
    the best of ``trials`` timings (a peak is what the machine reaches at best: on a shared VM a
    single timing of the square GEMM moved by 2x between runs, and with it the floor). The
    square GEMM's rate is the faster of ``a @ b`` and the engine's own linear layer (on a CPU its
    packed weights: in float32 MKL's ``a @ b`` reached 215 GFLOP/s where the packed path reached
    490, and a floor from the slower one sat below what the engine's matmuls already did). The
    bandwidth is the best sum over fresh 256 MiB buffers, far past any cache: a step's bytes are
    reads (weights, K/V), and on one 2-core VM a buffer read at 45 or at 80 GB/s depending on
    where its pages landed (a copy's rate moved the same way)."""
    def bench(fn, reps=5):
        fn()
        best = float("inf")
        for _ in range(trials):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t) / reps)
        return best

    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    sq = 2 * 1024 ** 3 / bench(lambda: a @ b)
    if a.device.type == "cpu":
        linear = engine_linear(b.t())  # a @ b through the engine's own (packed) linear
        sq = max(sq, 2 * 1024 ** 3 / bench(lambda: linear(a)))
    x, w = torch.randn(32, 896, dtype=dtype), torch.randn(4864 * 2, 896, dtype=dtype)
    dec = 2 * 32 * 896 * 4864 * 2 / bench(lambda: torch.nn.functional.linear(x, w), 20)
    bw = 0.0
    for _ in range(trials):  # a fresh buffer each: on a VM one buffer read at 45 GB/s, the next at 80
        src = torch.empty(256 * 2**20 // 4, dtype=torch.float32).fill_(1.0)  # touched: faults are not bandwidth
        src.sum()
        t = time.perf_counter()
        for _ in range(3):
            src.sum()
        bw = max(bw, 3 * src.numel() * 4 / (time.perf_counter() - t))
        del src
    return {"matmul_flops_1024": sq, "linear_flops_32x896x9728": dec, "read_bytes_per_s": bw}


def step_cost(engine, batch: int, context: int) -> dict[str, float]:
    """FLOPs and bytes of one decode step of ``batch`` sequences at ``context`` tokens."""
    model = engine.executor.runner.model
    cfg = engine.model_config.hf_config
    # Weight bytes as held (parameters and buffers: packed or quantized weights are buffers);
    # linear FLOPs from the layers' shapes, whatever form their weights take.
    seen, weight_bytes = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.layout != torch.strided or t.numel() == 0:  # oneDNN-packed: counted from its shape below
            continue
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()
    linear_params = 0
    # GGUF blocks kept in the file's format are neither parameters nor buffers (layers/quantization/
    # gguf.py sets ``gguf_bytes``): the linears' and an untied head's are read whole every step; the
    # embedding's only by the rows looked up, unless it is the tied head (its weight's ``gguf_blocks``).
    for m in model.modules():
        if isinstance(m, LinearBase):
            linear_params += m.input_size * m.output_size
            packed = getattr(m, "packed_weight", None)
            if packed is not None and packed.layout != torch.strided:
                weight_bytes += m.input_size * m.output_size * packed.element_size()
        if isinstance(m, LinearBase) or m is model.lm_head:
            weight_bytes += getattr(m, "gguf_bytes", 0)
    lm_params = cfg.vocab_size * cfg.hidden_size // engine.config.parallel_config.tensor_parallel_size
    linear_params += lm_params
    lm_weight = getattr(model.lm_head, "weight", None)  # absent when the head is quantized
    if getattr(cfg, "tie_word_embeddings", False) and lm_weight is not None:
        blocks = getattr(lm_weight, "gguf_blocks", None)
        # the tied embedding, read again as the head
        weight_bytes += int(blocks.raw.nbytes) if blocks is not None else lm_params * lm_weight.element_size()
    mc = engine.model_config
    heads = cfg.num_attention_heads
    attn_flops = cfg.num_hidden_layers * 2 * 2 * batch * context * heads * mc.head_dim
    runner = engine.executor.runner
    kv_bytes = (mc.kv_planes * cfg.num_hidden_layers * mc.num_kv_heads * mc.head_dim * runner.kv_cache_dtype.itemsize
                * runner.kv_block_rows / engine.config.cache_config.block_size * batch * context)
    return {"linear_flops": 2 * batch * linear_params, "attention_flops": attn_flops,
            "weight_bytes_read": weight_bytes, "kv_bytes_read": kv_bytes}


def _plot(result: dict, parts: dict, args: argparse.Namespace, step_s: float, context: int):
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(parts) + 1))
    names = list(result["breakdown_s"])[::-1]
    ax.barh(names, [result["breakdown_s"][n] * 1000 for n in names], color="tab:blue")
    ax.set_xlabel("ms per decode step")
    ax.set_title(f"{args.model or 'demo model'}: decode step, batch {args.batch_size}, context ~{context}: "
                 f"{step_s * 1000:.0f} ms", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return fig


def run(args: argparse.Namespace) -> dict:
    model, load_format = resolve_model(args.model, args.load_format, args.output_dir)
    warm = 2
    # Up to five measured phases (plain, the runner timed by phase, the Python loop, hooks, torch's
    # profiler), never finishing inside them; the margin covers the requests whose (chunked)
    # prefill ended in an earlier step and that are a few tokens ahead.
    max_tokens = 1 + warm + 5 * args.steps + 16
    max_len = args.context_len + max_tokens + 1
    tokens_needed = args.batch_size * (-(-max_len // args.block_size) + 1) * args.block_size
    # Size the KV cache from the model shape: enough for the whole batch, no preemption.
    cfg = EngineArgs(model=model, dtype=args.dtype, max_model_len=max_len).create_engine_config()
    mc = cfg.model_config
    per_token = mc.kv_planes * mc.hf_config.num_hidden_layers * mc.num_kv_heads * mc.head_dim * mc.dtype.itemsize  # >= int8's
    llm = LLM(model, dtype=args.dtype, load_format=load_format, max_model_len=max_len, block_size=args.block_size,
              max_num_seqs=args.batch_size, max_num_batched_tokens=max(2048, args.context_len),
              kv_cache_memory=tokens_needed * per_token, seed=args.seed, enable_prefix_caching=False,
              attention_backend=args.attention_backend, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    cuda = engine.config.device.startswith("cuda")
    timers = Timers(torch.cuda.synchronize if cuda else (lambda: None))
    rng = random.Random(args.seed)
    vocab = mc.hf_config.vocab_size
    for i in range(args.batch_size):
        engine.add_request(str(i), [rng.randrange(10, vocab) for _ in range(args.context_len)],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    try:
        # Prefill everything (chunked), then warm-up decodes.
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
        for _ in range(warm):
            engine.step()

        def decode_steps(n: int) -> float:
            t = time.perf_counter()
            sched = engine.scheduler
            for _ in range(n):
                assert not sched.waiting and len(sched.running) == args.batch_size and all(
                    r.num_tokens - r.num_computed_tokens == 1 for r in sched.running), "not a pure decode step"
                engine.step()
            if cuda:
                torch.cuda.synchronize()
            return (time.perf_counter() - t) / n

        plain = decode_steps(args.steps)
        # The hooks below time the Python layer loop's modules: the CPU layer runner (all layers in
        # one C call) has none, so from here on the loop runs; its own step time is reported too,
        # and its layers' phases as the runner itself timed them (clock reads between its calls).
        model_obj = engine.executor.runner.model
        layer_runner = model_obj.__dict__.get("_cpu_layer_runner")
        ran_runner = bool(layer_runner)
        runner_parts, runner_timed = {}, None
        if ran_runner:
            layer_runner.timing_on()
            runner_timed = decode_steps(args.steps)
            runner_parts = {k: v / args.steps for k, v in layer_runner.phase_seconds().items()}
            runner_parts["outside the layers (embedding, LM head, sampler, engine)"] = max(
                0.0, runner_timed - sum(runner_parts.values()))
            layer_runner.timings = None
        model_obj.use_cpu_layer_runner = False
        loop = decode_steps(args.steps) if ran_runner else plain
        instrument(engine, timers)
        timers.enabled = True
        hooked = decode_steps(args.steps)
        timers.enabled = False
        parts = breakdown(timers.total, args.steps)
        top_ops, aten_self = [], None
        profiled = None
        if not args.no_torch_profiler:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                profiled = decode_steps(args.steps)
            ka = prof.key_averages()
            ops = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
            aten_self = sum(e.self_cpu_time_total for e in ka if e.key.startswith(("aten::", "pagedllm::"))) / 1e6 / args.steps
            top_ops = [{"op": e.key, "calls_per_step": e.count / args.steps,
                        "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps} for e in ops[:25]]
            table = ka.table(sort_by="self_cpu_time_total", row_limit=30)
        context = args.context_len + warm + args.steps  # mean context of the measured steps, roughly
        cost = step_cost(engine, args.batch_size, context)
    finally:
        engine.shutdown()
    peaks = machine_peaks(mc.dtype) if not cuda else {}
    flops = cost["linear_flops"] + cost["attention_flops"]
    bytes_ = cost["weight_bytes_read"] + cost["kv_bytes_read"]
    floor = {}
    if peaks:
        floor = {"compute_floor_s": flops / peaks["matmul_flops_1024"],
                 "memory_floor_s": bytes_ / peaks["read_bytes_per_s"]}
        floor["floor_s"] = max(floor.values())
        floor["step_over_floor"] = plain / floor["floor_s"]
        # The same bounds per phase, summed: the linear layers (weights) and attention (the K/V
        # cache) run one after the other on the same cores, so one's memory time cannot hide
        # behind the other's arithmetic. A roofline per phase, as for a sequence of kernels.
        def bound(f, b):
            return max(f / peaks["matmul_flops_1024"], b / peaks["read_bytes_per_s"])

        floor["phases_floor_s"] = (bound(cost["linear_flops"], cost["weight_bytes_read"])
                                   + bound(cost["attention_flops"], cost["kv_bytes_read"]))
        floor["step_over_phases_floor"] = plain / floor["phases_floor_s"]
    total_parts = sum(parts.values())
    result = {
        **run_metadata(), "bench": "profile", "model": model, "load_format": load_format,
        "batch_size": args.batch_size, "context_len": args.context_len, "steps": args.steps,
        "final_outputs_only": getattr(engine, "final_outputs_only", None),
        "step_s": plain, "step_s_layer_loop": loop, "cpu_layer_runner": ran_runner, "step_s_instrumented": hooked, "step_s_torch_profiler": profiled,
        "step_s_runner_timed": runner_timed, "runner_breakdown_s": dict(sorted(runner_parts.items(), key=lambda kv: -kv[1])),
        "decode_tokens_per_s": args.batch_size / plain,
        "breakdown_s": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "breakdown_fraction": {k: v / total_parts for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "unaccounted_s": hooked - total_parts,
        "aten_self_s_per_step": aten_self,
        "outside_aten_fraction": (1 - aten_self / profiled) if aten_self is not None and profiled else None,
        "top_ops": top_ops, "cost": cost, "flops_per_step": flops, "bytes_per_step": bytes_,
        "machine_peaks": peaks, "floor": floor,
    }
    print(f"decode step, batch {args.batch_size}, context ~{context}: {plain * 1000:.1f} ms "
          f"({args.batch_size / plain:.1f} tok/s)"
          + (f"; Python layer loop {loop * 1000:.1f} ms (the breakdown's)" if ran_runner else "")
          + f"; instrumented {hooked * 1000:.1f} ms")
    for k, v in result["breakdown_s"].items():
        print(f"  {k:44s} {v * 1000:8.2f} ms  {100 * v / total_parts:5.1f}%")
    if runner_parts:
        print(f"the layer runner's own step, timed by phase: {runner_timed * 1000:.1f} ms")
        for k, v in result["runner_breakdown_s"].items():
            print(f"  {k:56s} {v * 1000:8.2f} ms  {100 * v / runner_timed:5.1f}%")
    if aten_self is not None:
        print(f"  time outside ATen ops (Python/framework): {100 * result['outside_aten_fraction']:.1f}% "
              f"of a profiled step")
    if floor:
        print(f"  FLOPs {flops / 1e9:.2f} G, bytes {bytes_ / 2**20:.0f} MiB per step; floor "
              f"{floor['floor_s'] * 1000:.1f} ms (compute {floor['compute_floor_s'] * 1000:.1f}, memory "
              f"{floor['memory_floor_s'] * 1000:.1f}); step is {floor['step_over_floor']:.2f}x the floor")
        print(f"  per phase (linears, then attention, each at its own bound, summed): "
              f"{floor['phases_floor_s'] * 1000:.1f} ms; step is {floor['step_over_phases_floor']:.2f}x that")
    fig = _plot(result, parts, args, plain, context)
    json_path, _ = write_result(args.output_dir, f"profile-{stamp()}", result, fig)
    if top_ops:
        ops_path = json_path[:-len(".json")] + "-ops.txt"
        with open(ops_path, "w") as f:
            f.write(table)
        print(f"the torch profiler's op table written to {ops_path}")
    return result
