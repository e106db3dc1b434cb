"""Offline throughput: the same prompts and output lengths through pagedllm and transformers.

Backends (``--backend``):

- ``pagedllm``: ``LLM.generate`` (paged KV cache, continuous batching, chunked prefill).
- ``hf``: transformers ``generate`` in static batches, left-padded. Requests are batched in
  arrival order, each batch as large as fits the KV budget when every sequence of the batch is
  padded to the batch's longest prompt and runs for its longest output (the output lengths are
  given to this baseline in advance, which favours it). Only the target output tokens count.
- ``hf-cb``: transformers' own continuous batching (``ContinuousBatchingManager``, the engine
  behind ``model.generate_batch``), with a paged cache of the same byte budget and page size.
- ``all``: the three in turn, then the ratios pagedllm / baseline.

All backends decode greedily, never stop early (no EOS), and get the same KV-cache budget in
bytes: ``--kv-cache-memory`` or, by default, ``--kv-fraction`` of what the whole workload's K/V
would take. Timings exclude model loading and a short warm-up request.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Optional

import torch

from pagedllm.benchmarks import datasets as ds
from pagedllm.benchmarks.common import parse_size, pyplot, run_metadata, stamp, summarize, write_result
from pagedllm.benchmarks.model_shapes import resolve_model
from pagedllm.config import DEFAULT_BLOCK_SIZE
from pagedllm.engine.arg_utils import EngineArgs, resolve_model_path
from pagedllm.layers.attention.kv_quant import block_rows
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

BACKENDS = ("pagedllm", "hf", "hf-cb")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="HF folder or hub id, or shape:qwen2-0.5b (a config of that shape, random weights); "
                        "default: the bundled demo model")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--dtype", default="auto")
    g.add_argument("--quantization", default=None, choices=["int8", "int8-g64"],
                   help="pagedllm only: int8 = W8A8")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="pagedllm only")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest request of the workload (throughput) / the model's (memory)")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV-cache budget in bytes, same for every backend (e.g. 256MiB)")
    g.add_argument("--kv-fraction", type=float, default=0.5,
                   help="without --kv-cache-memory: the budget is this fraction of the KV bytes of the whole "
                        "workload (prompts + outputs of all requests)")
    g.add_argument("--output-dir", default="bench_results")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    ds.add_dataset_args(p)
    p.add_argument("--backend", default="pagedllm", choices=BACKENDS + ("all",))
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="fixed static batch size for the hf backend (default: the largest that fits the budget)")
    p.add_argument("--no-warmup", action="store_true")
    p.set_defaults(func=run)


# ---- shared set-up ---------------------------------------------------------------------------
class Setup:
    """Resolved model, workload and budget shared by every backend of one run."""

    def __init__(self, args: argparse.Namespace, default_max_model_len: str = "workload") -> None:
        """``default_max_model_len``: without --max-model-len, use the workload's longest request
        ("workload") or the model's context length ("model")."""
        model, self.load_format = resolve_model(args.model, args.load_format, args.output_dir)
        self.model_path = resolve_model_path(model)
        vocab, special = ds.model_vocab(self.model_path)
        self.requests = ds.sample_requests(args, vocab, special)
        self.max_len = max(r.prompt_len + r.output_len for r in self.requests)
        max_model_len = args.max_model_len or (self.max_len if default_max_model_len == "workload" else None)
        cfg = EngineArgs(model=self.model_path, dtype=args.dtype, max_model_len=max_model_len,
                         block_size=args.block_size).create_engine_config()
        self.max_model_len = cfg.model_config.max_model_len
        if self.max_len > self.max_model_len:
            raise ValueError(f"the workload has a request of {self.max_len} tokens, more than "
                             f"--max-model-len {self.max_model_len}")
        self.hf_config = cfg.model_config.hf_config
        self.dtype = cfg.model_config.dtype
        mc = cfg.model_config
        self.kv_bytes_per_token = mc.kv_planes * self.hf_config.num_hidden_layers * mc.num_kv_heads * mc.head_dim * \
            self.dtype.itemsize
        total_tokens = sum(r.prompt_len + r.output_len for r in self.requests)
        if args.kv_cache_memory:
            self.kv_budget = parse_size(args.kv_cache_memory)
            how = "--kv-cache-memory"
        else:
            self.kv_budget = int(args.kv_fraction * total_tokens * self.kv_bytes_per_token)
            how = f"--kv-fraction {args.kv_fraction} x {total_tokens} workload tokens"
        bs = args.block_size
        self.kv_budget = max(self.kv_budget, -(-self.max_model_len // bs) * bs * self.kv_bytes_per_token)
        self.budget_info = {"kv_cache_bytes": self.kv_budget, "how": how,
                            "kv_bytes_per_token": self.kv_bytes_per_token,
                            "budget_tokens": self.kv_budget // self.kv_bytes_per_token,
                            "workload_tokens": total_tokens, "max_model_len": self.max_model_len,
                            "dtype": str(self.dtype).replace("torch.", "")}
        if getattr(args, "kv_cache_dtype", "auto") == "int8":  # pagedllm's int8 cache: more tokens, same bytes
            per_token = (mc.kv_planes * self.hf_config.num_hidden_layers * mc.num_kv_heads * mc.head_dim
                         * block_rows(bs, mc.head_dim, "int8") / bs)
            self.budget_info["budget_tokens_int8"] = int(self.kv_budget // per_token)


def _result(name: str, reqs: list[ds.BenchRequest], elapsed: float, per_request: list[dict], **extra) -> dict:
    n_in = sum(r.prompt_len for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    res = {"backend": name, "num_requests": len(reqs), "elapsed_s": elapsed, "total_prompt_tokens": n_in,
           "total_output_tokens": n_out, "requests_per_s": len(reqs) / elapsed,
           "total_tokens_per_s": (n_in + n_out) / elapsed, "output_tokens_per_s": n_out / elapsed,
           "ttft_ms": summarize((p.get("ttft_s") for p in per_request), 1000),
           "e2e_ms": summarize((p.get("e2e_s") for p in per_request), 1000),
           "per_request": per_request}
    res.update(extra)
    return res


# ---- pagedllm --------------------------------------------------------------------------------
def run_pagedllm(args: argparse.Namespace, s: Setup) -> dict:
    llm = LLM(s.model_path, dtype=args.dtype, max_model_len=s.max_model_len, block_size=args.block_size,
              kv_cache_memory=s.kv_budget, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, load_format=s.load_format, seed=args.seed,
              quantization=getattr(args, "quantization", None),
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    engine = llm.llm_engine
    try:
        if not args.no_warmup:
            llm.generate([{"prompt_token_ids": s.requests[0].prompt_token_ids[:16]}],
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        steps: list[tuple[float, int, int, float]] = []
        inner_step = engine.step

        def step():  # record the batch after every step (cheap: no tensor work)
            out = inner_step()
            st = engine.scheduler.get_stats()
            steps.append((time.perf_counter(), st.num_running, st.num_waiting, st.kv_cache_usage))
            return out

        engine.step = step
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in s.requests]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in s.requests]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        engine.step = inner_step
        per_request = []
        for r, o in zip(s.requests, outs):
            m = o.metrics
            per_request.append({"prompt_len": r.prompt_len, "output_len": r.output_len,
                                "generated": len(o.outputs[0].token_ids),
                                "ttft_s": m.first_token_time - m.arrival_time if m.first_token_time else None,
                                "e2e_s": m.finished_time - m.arrival_time if m.finished_time else None})
        stats = engine.get_stats()
        running = [x[1] for x in steps]
        return _result("pagedllm", s.requests, elapsed, per_request, num_steps=len(steps),
                       num_kv_blocks=engine.config.cache_config.num_blocks, block_size=args.block_size,
                       max_running=max(running, default=0), mean_running=sum(running) / max(1, len(running)),
                       num_preemptions=stats.num_preemptions,
                       steps=[{"t": t - t0, "running": r, "waiting": w, "kv_usage": u} for t, r, w, u in steps])
    finally:
        engine.shutdown()


# ---- transformers ----------------------------------------------------------------------------
def build_hf_model(s: Setup):
    """The transformers model of the same checkpoint, or of the same config with random init."""
    from transformers import AutoModelForCausalLM  # lazily: transformers, ~1 s to import

    if s.load_format == "dummy":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(s.hf_config, dtype=s.dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=s.dtype, attn_implementation="sdpa")
    return model.eval()


def static_batches(reqs: list[ds.BenchRequest], budget_tokens: int, fixed: Optional[int]) -> list[list[int]]:
    """Arrival-order batches; each as large as fits ``budget_tokens`` of padded K/V
    (batch size x (longest prompt + longest output of the batch)), or of size ``fixed``."""
    if fixed:
        return [list(range(i, min(i + fixed, len(reqs)))) for i in range(0, len(reqs), fixed)]
    batches: list[list[int]] = []
    cur: list[int] = []
    max_in = max_out = 0
    for i, r in enumerate(reqs):
        new_in, new_out = max(max_in, r.prompt_len), max(max_out, r.output_len)
        if cur and (len(cur) + 1) * (new_in + new_out) > budget_tokens:
            batches.append(cur)
            cur, new_in, new_out = [], r.prompt_len, r.output_len
        cur.append(i)
        max_in, max_out = new_in, new_out
    if cur:
        batches.append(cur)
    return batches


@torch.inference_mode()
def _hf_generate(model, batch: list[list[int]], max_new: int, pad_id: int) -> torch.Tensor:
    from transformers import GenerationConfig  # lazily: transformers, ~1 s to import

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    # generate() fills unset (None) fields from the model's generation config, EOS included:
    # min_new_tokens masks EOS until max_new_tokens, so every row runs the full length.
    gen = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)


def run_hf(args: argparse.Namespace, s: Setup) -> dict:
    model = build_hf_model(s)
    pad_id = s.hf_config.pad_token_id if getattr(s.hf_config, "pad_token_id", None) is not None else 0
    if not args.no_warmup:
        _hf_generate(model, [s.requests[0].prompt_token_ids[:16]], 4, pad_id)
    budget_tokens = s.kv_budget // s.kv_bytes_per_token
    batches = static_batches(s.requests, budget_tokens, args.hf_batch_size)
    per_request: list[dict] = [{} for _ in s.requests]
    batch_info = []
    t0 = time.perf_counter()
    for bi, idx in enumerate(batches):
        reqs = [s.requests[i] for i in idx]
        max_new = max(r.output_len for r in reqs)
        out = _hf_generate(model, [r.prompt_token_ids for r in reqs], max_new, pad_id)
        t = time.perf_counter() - t0
        width = max(r.prompt_len for r in reqs)
        generated = out.shape[1] - width
        batch_info.append({"size": len(idx), "padded_prompt_len": width, "steps": generated, "end_s": t,
                           "kv_tokens": len(idx) * (width + generated)})
        for i, r in zip(idx, reqs):
            per_request[i] = {"prompt_len": r.prompt_len, "output_len": r.output_len, "generated": generated,
                              "batch": bi, "ttft_s": None, "e2e_s": t}
    elapsed = time.perf_counter() - t0
    del model
    gc.collect()
    useful = sum(r.output_len for r in s.requests)
    computed = sum(b["size"] * b["steps"] for b in batch_info)
    return _result("hf", s.requests, elapsed, per_request, batches=batch_info,
                   max_batch_size=max(b["size"] for b in batch_info),
                   mean_batch_size=len(s.requests) / len(batch_info),
                   generated_tokens_incl_padding=computed, useful_output_fraction=useful / max(1, computed),
                   note="TTFT is not observable with static batching (every output arrives at the batch's end)")


def run_hf_cb(args: argparse.Namespace, s: Setup) -> dict:
    try:  # lazily: transformers, ~1 s to import; an older one lacks these
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig
    except ImportError as e:
        return {"backend": "hf-cb", "skipped": f"this transformers has no continuous batching ({e})"}
    model = build_hf_model(s)
    if not hasattr(model, "generate_batch") or not hasattr(model, "continuous_batching_context_manager"):
        return {"backend": "hf-cb", "skipped": "this transformers has no generate_batch / continuous batching"}
    page = args.block_size
    num_blocks = max(1, s.kv_budget // (page * s.kv_bytes_per_token))
    cb_cfg = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks,
                                      max_batch_tokens=args.max_num_batched_tokens,
                                      max_requests_per_batch=args.max_num_seqs, allow_block_sharing=False)
    pad_id = s.hf_config.pad_token_id if getattr(s.hf_config, "pad_token_id", None) is not None else 0
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad_id,
                           max_new_tokens=max(r.output_len for r in s.requests))

    def wait(mgr, ids: set[str], timeout: float = 600.0) -> dict:
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < len(ids) and time.monotonic() < deadline:
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    break
                continue
            if r.request_id in ids and r.is_finished():
                results[r.request_id] = r
        return results

    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb_cfg, warmup=False) as mgr:
        if not args.no_warmup:
            rid = mgr.add_request(s.requests[0].prompt_token_ids[:16], request_id="warmup", max_new_tokens=4,
                                  eos_token_id=-1)
            wait(mgr, {rid})
        t0 = time.perf_counter()
        created = {}
        ids = []
        for i, r in enumerate(s.requests):
            rid = f"bench-{i}"
            created[rid] = time.perf_counter()
            mgr.add_request(list(r.prompt_token_ids), request_id=rid, max_new_tokens=r.output_len,
                            eos_token_id=-1, record_timestamps=True)
            ids.append(rid)
        results = wait(mgr, set(ids))
        elapsed = time.perf_counter() - t0
    del model
    gc.collect()
    if len(results) < len(ids):
        return {"backend": "hf-cb", "skipped": f"only {len(results)} of {len(ids)} requests finished"}
    per_request = []
    for rid, r in zip(ids, s.requests):
        out = results[rid]
        ts = out.timestamps or []
        per_request.append({"prompt_len": r.prompt_len, "output_len": r.output_len,
                            "generated": len(out.generated_tokens), "error": out.error,
                            "ttft_s": ts[0] - t0 if ts else None,
                            "e2e_s": (ts[-1] if ts else out.lifespan[1]) - t0})
    return _result("hf-cb", s.requests, elapsed, per_request, num_kv_blocks=num_blocks, page_size=page,
                   transformers_config={"page_size": page, "num_blocks": num_blocks,
                                        "max_batch_tokens": args.max_num_batched_tokens,
                                        "max_requests_per_batch": args.max_num_seqs})


RUNNERS = {"pagedllm": run_pagedllm, "hf": run_hf, "hf-cb": run_hf_cb}


# ---- the command -----------------------------------------------------------------------------
def _plot(results: dict[str, dict], title: str):
    plt = pyplot()
    if plt is None:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [n for n, r in results.items() if "skipped" not in r]
    vals = [results[n]["output_tokens_per_s"] for n in names]
    colors = {"pagedllm": "tab:green", "hf": "tab:gray", "hf-cb": "tab:blue"}
    bars = a1.bar(names, vals, color=[colors[n] for n in names])
    for b, v in zip(bars, vals):
        a1.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    a1.set_ylabel("output tokens / s")
    a1.set_title("offline throughput")
    for n in names:
        e2e = sorted(p["e2e_s"] for p in results[n]["per_request"] if p.get("e2e_s") is not None)
        if e2e:
            a2.step(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], where="post", label=n, color=colors[n])
    a2.set_xlabel("request completion time since start (s)")
    a2.set_ylabel("fraction of requests done")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return fig


def run(args: argparse.Namespace) -> dict:
    s = Setup(args)
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    wl = ds.describe(args, s.requests)
    print(f"workload: {wl['distribution']}; {wl['total_prompt_tokens']} prompt + {wl['total_output_tokens']} "
          f"output tokens; KV budget {s.kv_budget / 2**20:.1f} MiB = {s.budget_info['budget_tokens']} tokens"
          + (f" ({s.budget_info['budget_tokens_int8']} in pagedllm's int8 cache)"
             if "budget_tokens_int8" in s.budget_info else ""))
    results: dict[str, dict] = {}
    for b in backends:
        t, load = time.perf_counter(), os.getloadavg()[0]
        res = RUNNERS[b](args, s)
        res["wall_incl_load_s"] = time.perf_counter() - t
        # 1-minute load average before/after: other processes on the machine skew a comparison.
        res["loadavg_1min_before_after"] = [load, os.getloadavg()[0]]
        results[b] = res
        if "skipped" in res:
            print(f"[{b}] skipped: {res['skipped']}")
        else:
            print(f"[{b}] {res['elapsed_s']:.2f} s  {res['requests_per_s']:.3f} req/s  "
                  f"{res['total_tokens_per_s']:.1f} total tok/s  {res['output_tokens_per_s']:.2f} output tok/s")
        gc.collect()
    ratios = {}
    if "pagedllm" in results and "skipped" not in results["pagedllm"]:
        p = results["pagedllm"]
        for b, r in results.items():
            if b != "pagedllm" and "skipped" not in r:
                ratios[f"pagedllm/{b}"] = {k: p[k] / r[k] for k in
                                          ("output_tokens_per_s", "requests_per_s", "total_tokens_per_s")}
                print(f"pagedllm / {b}: output throughput x{ratios[f'pagedllm/{b}']['output_tokens_per_s']:.2f}")
    name = f"throughput-{stamp()}"
    out = {**run_metadata(), "bench": "throughput", "model": s.model_path, "load_format": s.load_format,
           "workload": wl, "budget": s.budget_info, "results": results, "ratios": ratios}
    title = (f"{args.model or 'demo model'}: {len(s.requests)} requests ({args.dataset}), "
             f"KV budget {s.kv_budget / 2**20:.1f} MiB ({s.budget_info['budget_tokens']} tokens)")
    write_result(args.output_dir, name, out, _plot(results, title))
    return out
