"""KV-cache memory efficiency: how much of the reserved KV memory holds live tokens.

The workload runs through the real engine (scheduler, KV-cache manager, block pool; the model
too unless ``--skip-forward``, which stubs the forward pass: with forced output lengths the
schedule is the same). After every step it records

- live tokens: the sum of ``num_computed_tokens`` of the running requests (tokens whose K/V are
  in the cache; with a sliding window W on every layer, at most the W - 1 a next query still reads),
- reserved tokens: blocks held by requests x ``block_size``,
- requests held (running).

The same workload is then replayed through a simulated scheduler with the same token budget per
step but contiguous per-request KV reservations, as the systems the vLLM paper compares with
(Kwon et al., SOSP 2023, fig. 2 / sec. 6): ``contiguous-max`` reserves ``max_model_len`` tokens per
request (output length unknown in advance, like Orca (Max)); ``contiguous-oracle`` reserves
exactly prompt + output length (an upper bound no real system reaches, like Orca (Oracle)).
All three get the same KV budget in bytes.

Reported per scheme: utilization = sum over steps of live tokens / sum of reserved tokens (and
its complement, the waste), the mean of the per-step ratio, requests held at once (max, mean),
and the number of steps the workload took.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm.benchmarks import datasets as ds
from pagedllm.benchmarks.common import pyplot, run_metadata, stamp, write_result
from pagedllm.benchmarks.throughput import Setup, add_model_args
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    ds.add_dataset_args(p)
    p.add_argument("--skip-forward", action="store_true",
                   help="stub the model's forward pass (same schedule, much faster on big models)")
    p.set_defaults(func=run)


def _summary(steps: list[dict], budget_tokens: int) -> dict:
    live = sum(s["live"] for s in steps)
    reserved = sum(s["reserved"] for s in steps)
    ratios = [s["live"] / s["reserved"] for s in steps if s["reserved"]]
    held = [s["running"] for s in steps]
    util = live / reserved if reserved else float("nan")
    return {"num_steps": len(steps), "utilization": util, "waste": 1 - util,
            "mean_step_utilization": sum(ratios) / len(ratios) if ratios else float("nan"),
            "min_step_utilization": min(ratios) if ratios else float("nan"),
            "max_requests_held": max(held, default=0), "mean_requests_held": sum(held) / max(1, len(held)),
            "mean_reserved_fraction_of_budget": reserved / max(1, len(steps)) / budget_tokens,
            "mean_live_fraction_of_budget": live / max(1, len(steps)) / budget_tokens}


def run_paged(args: argparse.Namespace, s: Setup) -> tuple[list[dict], dict]:
    llm = LLM(s.model_path, dtype=args.dtype, max_model_len=s.max_model_len, block_size=args.block_size,
              kv_cache_memory=s.kv_budget, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, load_format=s.load_format, seed=args.seed)
    engine = llm.llm_engine
    if args.skip_forward:
        vocab = s.hf_config.vocab_size

        def stub(model_input):
            return torch.zeros(len(model_input.logits_indices), vocab)

        engine.executor.execute_model = stub
    kv, sched, pool = engine.kv_cache_manager, engine.scheduler, engine.kv_cache_manager.block_pool
    for i, r in enumerate(s.requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    # With a sliding window W on every layer, only a request's last W - 1 tokens are still read.
    keep = kv.sliding_window - 1 if kv.sliding_window else float("inf")
    steps = []
    generated = {}
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    generated[out.request_id] = len(out.outputs[0].token_ids)
            held = pool.num_usable_blocks - pool.get_num_free_blocks()
            live = sum(min(r.num_computed_tokens, keep) for r in sched.running)
            # Cross-check: blocks the running requests' tables hold (shared blocks once).
            table_blocks = len({b.block_id for blocks in kv.req_to_blocks.values() for b in blocks if b is not kv.null_block})
            steps.append({"t": time.perf_counter() - t0, "running": len(sched.running), "waiting": len(sched.waiting),
                          "live": live, "reserved": held * kv.block_size, "table_blocks": table_blocks})
    finally:
        engine.shutdown()
    info = {"num_blocks": pool.num_blocks, "block_size": kv.block_size, "elapsed_s": time.perf_counter() - t0,
            "num_preemptions": sched.num_preemptions, "forward": "stubbed" if args.skip_forward else "real",
            "generated_tokens": sum(generated.values()),
            "all_requests_full_length": all(generated.get(str(i)) == r.output_len for i, r in enumerate(s.requests))}
    return steps, info


def simulate_contiguous(reqs: list[ds.BenchRequest], budget_tokens: int, max_model_len: int,
                        max_batched_tokens: int, max_num_seqs: int, oracle: bool) -> list[dict]:
    """FCFS continuous batching with one contiguous KV reservation per request (``max_model_len``
    tokens, or prompt + output when ``oracle``), the same per-step token budget and chunked prefill
    as pagedllm's scheduler. Returns the same per-step records as the paged run."""
    waiting = list(range(len(reqs)))
    running: list[int] = []
    computed = [0] * len(reqs)
    generated = [0] * len(reqs)
    reserve = [(r.prompt_len + r.output_len) if oracle else max_model_len for r in reqs]
    steps = []
    while waiting or running:
        budget = max_batched_tokens
        sched: list[tuple[int, int]] = []
        for i in running:
            if budget <= 0:
                break
            n = min(reqs[i].prompt_len + generated[i] - computed[i], budget)
            sched.append((i, n))
            budget -= n
        reserved = sum(reserve[i] for i in running)
        while waiting and budget > 0 and len(running) < max_num_seqs and \
                reserved + reserve[waiting[0]] <= budget_tokens:
            i = waiting.pop(0)
            running.append(i)
            reserved += reserve[i]
            n = min(reqs[i].prompt_len, budget)
            sched.append((i, n))
            budget -= n
        if not sched:
            raise ValueError("a request does not fit the KV budget even alone")
        for i, n in sched:
            computed[i] += n
            if computed[i] == reqs[i].prompt_len + generated[i]:  # reached the end: sample one token
                generated[i] += 1
                if generated[i] >= reqs[i].output_len:
                    running.remove(i)
        steps.append({"running": len(running), "waiting": len(waiting),
                      "live": sum(computed[i] for i in running), "reserved": sum(reserve[i] for i in running)})
    return steps


def _plot(schemes: dict[str, list[dict]], summaries: dict[str, dict], title: str):
    plt = pyplot()
    if plt is None:
        return None
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.6))
    colors = {"paged (pagedllm)": "tab:green", "contiguous-max": "tab:red", "contiguous-oracle": "tab:orange"}
    for name, steps in schemes.items():
        n = max(1, len(steps))
        x = [i / n for i in range(len(steps))]  # schemes take different numbers of steps
        c = colors.get(name)
        a1.plot(x, [s["live"] / s["reserved"] if s["reserved"] else float("nan") for s in steps], label=name, color=c,
                lw=1)
        a2.plot(x, [s["running"] for s in steps], label=f"{name} ({len(steps)} steps)", color=c, lw=1)
    a1.set_ylabel("live tokens / reserved KV slots")
    a1.set_ylim(0, 1.05)
    a2.set_ylabel("requests held at once")
    for a in (a1, a2):
        a.set_xlabel("fraction of the run (engine steps)")
        a.grid(alpha=0.3)
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    names = list(summaries)
    waste = [100 * summaries[k]["waste"] for k in names]
    bars = a3.bar([k.split(" ")[0].replace("-", "\n") for k in names], waste, color=[colors.get(k) for k in names])
    for b, k, w in zip(bars, names, waste):
        a3.annotate(f"{w:.1f}%\nmax {summaries[k]['max_requests_held']} held", (b.get_x() + b.get_width() / 2, w),
                    ha="center", va="bottom", fontsize=8)
    a3.set_ylabel("KV waste: reserved but not live (%)")
    a3.set_ylim(0, 115)
    fig.suptitle(title, fontsize=9)
    return fig


def run(args: argparse.Namespace) -> dict:
    s = Setup(args, default_max_model_len="model")
    budget_tokens = s.kv_budget // s.kv_bytes_per_token
    wl = ds.describe(args, s.requests)
    print(f"workload: {wl['distribution']}; KV budget {s.kv_budget / 2**20:.1f} MiB = {budget_tokens} tokens; "
          f"max_model_len {s.max_model_len}")
    paged_steps, paged_info = run_paged(args, s)
    # The paged pool holds whole blocks: give the simulations the same number of token slots.
    slots = paged_info["num_blocks"] * paged_info["block_size"]
    schemes = {"paged (pagedllm)": paged_steps}
    for name, oracle in (("contiguous-max", False), ("contiguous-oracle", True)):
        schemes[name] = simulate_contiguous(s.requests, slots, s.max_model_len, args.max_num_batched_tokens,
                                            args.max_num_seqs, oracle)
    summaries = {name: _summary(st, slots) for name, st in schemes.items()}
    summaries["paged (pagedllm)"].update(paged_info)
    for name, sm in summaries.items():
        print(f"[{name}] utilization {100 * sm['utilization']:.1f}% (waste {100 * sm['waste']:.1f}%), "
              f"requests held max {sm['max_requests_held']} mean {sm['mean_requests_held']:.1f}, "
              f"{sm['num_steps']} steps")
    out = {**run_metadata(), "bench": "memory", "model": s.model_path, "load_format": s.load_format,
           "workload": wl, "budget": {**s.budget_info, "slots": slots}, "schemes": summaries,
           "steps": schemes}
    title = (f"{args.model or 'demo model'}: {len(s.requests)} requests ({args.dataset}), KV budget {slots} tokens, "
             f"max_model_len {s.max_model_len}, block {args.block_size}")
    write_result(args.output_dir, f"memory-{stamp()}", out, _plot(schemes, summaries, title))
    return out
