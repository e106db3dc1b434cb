"""The engine's host time per decode step, with a model whose compute is about zero.

Which part of a step is Python, not the model? The bench writes a 1-layer, hidden-64 random Llama
(transformers' random init, seed 0) and a byte-level BPE tokenizer (``tokenizers``) into a temporary
folder (nothing is downloaded), then for each ``--batch-sizes`` entry B and each progress-bar setting
(``--bar both``: off, then on) runs B requests (``--prompt-len`` random prompt tokens, exactly
``--steps`` + 1 output tokens, greedy) through ``LLM.generate``'s own loop (``LLM._run_engine``:
``LLMEngine.step`` until done, the bar updated as generate does). Every request is prefilled in the
first step, so the next ``--steps`` steps are pure decode steps of the whole batch; only those count.

Each setting runs ``--repeats`` times two ways (the bar settings alternating; the fastest run of each
way is reported, as a shared host's load only ever adds time): with only a clock read around each
``LLMEngine.step`` (the step's wall time, and the time between two steps: the driver loop, i.e. the
progress bar and collecting finished outputs), and with timing wrappers around the engine's parts
(as ``pagedllm bench profile`` wraps them; no engine file is changed), which split a step into
disjoint phases:

- ``schedule``: ``Scheduler.schedule`` (the KV manager's slot allocation included);
- ``prepare_inputs``: the flat batch built from the scheduled requests (``engine/input_batch.py``);
- ``forward``: ``executor.execute_model`` (the model, on CPU synchronous);
- ``sample``: the sampler;
- ``update_requests``: ``Scheduler.update_from_output`` (append tokens, stop checks, free finished);
- ``detokenize``: ``OutputProcessor.process`` (incremental detokenization, stop strings);
- ``make_outputs``: ``OutputProcessor.make_output`` (the RequestOutputs);
- ``engine_other``: the rest of ``LLMEngine.step`` (sampling rows, counters, the finished checks);
- ``driver``: between two steps, outside the engine (``LLM._run_engine``: the progress bar, the dict of
  finished outputs; the last step's share runs to the end of the loop, the bar's close included).

The phases sum to the timed run's step (µs per step and per sequence per step). The result JSON
holds, per batch size and bar setting, ``step_us`` (uninstrumented; ``step_us_all`` every repeat),
``step_us_timed``, ``phases_us`` (per step), ``phases_us_per_seq`` and ``us_per_seq_step``;
``bar_over_no_bar`` the ratio of the two bar settings' uninstrumented steps.

With ``--served`` the same model and engine settings are then served (``pagedllm serve`` on 127.0.0.1, a
free port, its log next to the JSON): per batch size B, B streaming ``/v1/completions`` requests at once
(``pagedllm bench serve``'s client, httpx), each ``--steps`` + 1 tokens; ``served`` in the JSON gives
output tok/s over the run (prefill and HTTP included) and µs of wall time per output token, the best of
``--repeats``.

``--clock cpu`` times with ``time.process_time`` (this process's CPU time) instead of the wall clock:
on a host shared with other jobs it leaves out the time they hold the cores.

The model runs on ``--num-threads`` (default 1) CPU threads: its matmuls are 64 wide, and a second
OpenMP thread only adds a hand-off per op (on a shared 2-core host it made the same run swing 2-3x).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Callable, Optional

import torch

from pagedllm.benchmarks import serve as serve_bench
from pagedllm.benchmarks.common import pyplot, run_metadata, stamp, wrap_engine_parts, write_result
from pagedllm.benchmarks.datasets import BenchRequest
from pagedllm.benchmarks.model_shapes import build_tokenizer
from pagedllm.engine.arg_utils import cli_flag
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update_requests", "detokenize", "make_outputs",
          "engine_other", "driver")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,64,256,1024",
                   help="comma-separated numbers of sequences decoding together")
    p.add_argument("--steps", type=int, default=64, help="decode steps measured per run")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each setting (bar off and on alternating); the fastest is reported")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens of each request")
    p.add_argument("--bar", default="both", choices=["both", "on", "off"],
                   help="the progress bar (LLM.generate's use_tqdm): each setting, or both in turn")
    p.add_argument("--vocab-size", type=int, default=512, help="the nano model's vocabulary")
    p.add_argument("--num-threads", type=int, default=1, help="CPU threads for the (64-wide) model")
    p.add_argument("--model", default=None,
                   help="an HF folder to use instead of the nano model (written to a temp dir by default)")
    p.add_argument("--served", action="store_true",
                   help="also serve the model (pagedllm serve on 127.0.0.1) and stream B requests at once "
                        "per batch size")
    p.add_argument("--served-timeout", type=float, default=300.0,
                   help="seconds the server may take to start, and each streamed request to finish")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: time.perf_counter; cpu: time.process_time, the CPU time of this process only "
                        "(on a shared, loaded host the wall clock also counts the time other jobs hold the "
                        "cores; compare like with like)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def write_nano_model(out_dir: str, vocab_size: int = 512, seed: int = 0) -> str:
    """A 1-layer, hidden-64 random Llama (float32 safetensors) and a byte-level BPE tokenizer of
    ``vocab_size`` ids in ``out_dir``. Returns ``out_dir``."""
    import transformers  # lazily: transformers, ~1 s to import (the bench CLI is imported by --help)

    tok = build_tokenizer(out_dir, vocab_size, bpe_vocab_size=min(vocab_size, 1024))
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


class StepClock:
    """Times ``LLMEngine.step`` and the gaps between steps, counting only pure decode steps of the
    whole batch (every running request one token to compute, none waiting). With ``parts_on``, also
    the engine's parts (wrapped by :meth:`wrap`) inside those steps."""

    def __init__(self, engine, batch: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine, self.batch, self.clock = engine, batch, clock
        self.parts_on = False
        self.reset()
        step = engine.step

        def timed_step():
            if self.last_pure_end is not None:
                self.total["driver"] += self.clock() - self.last_pure_end
                self.last_pure_end = None
            sched = engine.scheduler  # the check (O(batch)) is outside both the step and the driver
            pure = (not sched.waiting and len(sched.running) == self.batch
                    and all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running))
            self.in_pure = pure
            t = self.clock()
            try:
                return step()
            finally:
                end = self.clock()
                self.in_pure = False
                if pure:
                    self.steps += 1
                    self.step_s += end - t
                    self.last_pure_end = end

        engine.step = timed_step

    def reset(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.steps, self.step_s = 0, 0.0
        self.in_pure = False
        self.last_pure_end: Optional[float] = None

    def end(self) -> None:
        """The driver loop has returned: the last pure step's gap ends here."""
        if self.last_pure_end is not None:
            self.total["driver"] += self.clock() - self.last_pure_end
            self.last_pure_end = None

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            if not (self.parts_on and self.in_pure):
                return fn(*a, **kw)
            t = self.clock()
            try:
                return fn(*a, **kw)
            finally:
                self.total[name] += self.clock() - t
        return timed


def instrument(engine, clock: StepClock) -> None:
    """Wrap the engine's parts (instance attributes)."""
    wrap_engine_parts(engine, clock.wrap)


def measure(llm: LLM, clock: StepClock, batch: int, steps: int, prompt_len: int, vocab: int, use_tqdm: bool,
            seed: int) -> tuple[float, int]:
    """Run ``batch`` requests through ``LLM._run_engine`` (as ``generate`` does); returns (seconds of
    the pure decode steps and the driver after them, number of those steps)."""
    engine = llm.llm_engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]},
                              params) for _ in range(batch)]
    clock.reset()
    llm._run_engine(ids, use_tqdm)
    clock.end()
    return clock.step_s + clock.total["driver"], clock.steps


def _engine_settings(args: argparse.Namespace, batches: list[int]) -> dict:
    """The engine settings of every run (offline and served): the whole batch prefilled in one step."""
    return dict(num_threads=args.num_threads, max_model_len=args.prompt_len + args.steps + 2,
                max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
                seed=args.seed)


def _engine_flags(args: argparse.Namespace, batches: list[int]) -> list[str]:
    """:func:`_engine_settings` as ``pagedllm serve`` flags."""
    return [a for k, v in _engine_settings(args, batches).items() for a in (cli_flag(k), str(v))]


SERVED_MODEL_NAME = "nano"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(args: argparse.Namespace, model: str, batches: list[int], vocab: int, log_path: str) -> list[dict]:
    """``pagedllm serve`` of ``model`` on 127.0.0.1 (a free port, the same engine settings as the
    offline runs), then for each batch size B: B streaming ``/v1/completions`` requests at once,
    each its ``--steps`` + 1 tokens (greedy, ignore_eos). Returns per B the output tok/s over the
    run, µs of wall time per output token and the failed requests. The server is stopped (SIGTERM,
    then SIGKILL after 30 s) whatever happens. A failed request is counted (``failed_requests``,
    ``first_error``), not fatal: the offline figures are still written."""
    import httpx  # lazily: httpx is optional (pagedllm[bench]); the offline figures need none

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_MODEL_NAME,
           "--limit-concurrency", str(max(1000, max(batches) + 16)), *_engine_flags(args, batches)]
    out = []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + args.served_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"pagedllm serve exited with {proc.returncode} while starting (log: {log_path})")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pagedllm serve not healthy after {args.served_timeout} s (log: {log_path})")
                time.sleep(0.25)
            rng = random.Random(args.seed)
            client = argparse.Namespace(base_url=url, endpoint="completions", model=SERVED_MODEL_NAME,
                                        api_key="EMPTY", timeout=args.served_timeout, max_concurrency=None,
                                        request_rate=float("inf"), seed=args.seed)
            warm = [BenchRequest([5, 6, 7], 4)] * 2  # the first requests pay for connections and first calls
            asyncio.run(serve_bench._run_async(client, warm, [r.prompt_token_ids for r in warm]))
            for batch in batches:
                reqs = [BenchRequest([rng.randrange(3, vocab) for _ in range(args.prompt_len)], args.steps + 1)
                        for _ in range(batch)]
                best = None
                for _ in range(args.repeats):
                    results, wall = asyncio.run(serve_bench._run_async(client, reqs,
                                                                       [r.prompt_token_ids for r in reqs]))
                    tokens = sum(r.output_tokens for r in results if r.success)
                    failed = [r.error for r in results if not r.success]
                    if best is None or (len(failed), wall) < (len(best[2]), best[0]):
                        best = (wall, tokens, failed)
                wall, tokens, failed = best
                r = {"batch_size": batch, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                     "us_per_token": wall / tokens * 1e6 if tokens else None, "failed_requests": len(failed),
                     "first_error": failed[0] if failed else None}
                if failed:
                    print(f"served batch {batch}: {len(failed)} of {batch} requests failed, e.g. {failed[0]}")
                out.append(r)
                print(f"served batch {batch:5d}: {tokens / wall:,.0f} output tok/s ({r['us_per_token'] or 0:.1f} us a "
                      f"token of wall time, {batch} streams at once)")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return out


def _plain_step_us(llm: LLM, clock: StepClock, batch: int, args: argparse.Namespace, vocab: int,
                   use_tqdm: bool) -> float:
    """µs per pure decode step (the driver loop after it included), only the step clock on."""
    clock.parts_on = False
    wall, n = measure(llm, clock, batch, args.steps, args.prompt_len, vocab, use_tqdm, args.seed)
    if n != args.steps:
        raise RuntimeError(f"batch {batch}: {n} pure decode steps of the whole batch, expected {args.steps} "
                           f"(were the requests prefilled in one step?)")
    return wall / n * 1e6


def _timed_step_us(llm: LLM, clock: StepClock, batch: int, args: argparse.Namespace, vocab: int,
                   use_tqdm: bool) -> tuple[float, dict[str, float]]:
    """(µs per pure decode step, µs per step of each of PHASES) with the parts' timers on; the
    phases sum to the step."""
    clock.parts_on = True
    try:
        wall, n = measure(llm, clock, batch, args.steps, args.prompt_len, vocab, use_tqdm, args.seed)
    finally:
        clock.parts_on = False
    step = clock.step_s / n
    inner = sum(v for k, v in clock.total.items() if k != "driver") / n
    phases = {k: clock.total.get(k, 0.0) / n for k in PHASES if k not in ("engine_other", "driver")}
    phases["engine_other"] = max(0.0, step - inner)
    phases["driver"] = clock.total.get("driver", 0.0) / n
    return wall / n * 1e6, {k: phases[k] * 1e6 for k in PHASES}


def run(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.steps < 1 or args.repeats < 1:
        raise ValueError("--batch-sizes must be positive integers, --steps and --repeats >= 1")
    bars = {"both": [False, True], "on": [True], "off": [False]}[args.bar]
    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="pagedllm-nano-")
        model = write_nano_model(tmp, args.vocab_size, args.seed)
    try:
        llm = LLM(model, **_engine_settings(args, batches))
        engine = llm.llm_engine
        vocab = engine.model_config.hf_config.vocab_size
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        try:
            # One clock and the parts' wrappers for the whole run: with parts_on False a wrapper is one
            # call and a flag test (a few per step, not per sequence).
            clock = StepClock(engine, 0, time.process_time if args.clock == "cpu" else time.perf_counter)
            instrument(engine, clock)
            runs = []
            for batch in batches:
                clock.batch = batch
                plain: dict[bool, list[float]] = {b: [] for b in bars}
                timed: dict[bool, list[tuple[float, dict[str, float]]]] = {b: [] for b in bars}
                for _ in range(args.repeats):  # the bar settings alternate: a burst of load hits both alike
                    for use_tqdm in bars:
                        plain[use_tqdm].append(_plain_step_us(llm, clock, batch, args, vocab, use_tqdm))
                        timed[use_tqdm].append(_timed_step_us(llm, clock, batch, args, vocab, use_tqdm))
                for use_tqdm in bars:
                    step_us = min(plain[use_tqdm])
                    step_us_timed, phases_us = min(timed[use_tqdm], key=lambda t: t[0])
                    r = {"batch_size": batch, "progress_bar": use_tqdm, "decode_steps": args.steps,
                         "step_us": step_us, "step_us_all": plain[use_tqdm], "us_per_seq_step": step_us / batch,
                         "tokens_per_s": batch / (step_us / 1e6), "step_us_timed": step_us_timed,
                         "phases_us": phases_us, "phases_us_per_seq": {k: v / batch for k, v in phases_us.items()}}
                    runs.append(r)
                    print(f"batch {batch:5d} bar {'on ' if use_tqdm else 'off'}: {step_us:9.1f} us/step "
                          f"{step_us / batch:7.2f} us/seq-step ({batch / step_us * 1e6:,.0f} tok/s); timed run "
                          f"{step_us_timed:.1f} us/step, per seq: "
                          + ", ".join(f"{k} {v / batch:.2f}" for k, v in phases_us.items()))
        finally:
            engine.shutdown()
        del llm, engine
        served_runs = None
        if args.served:
            os.makedirs(args.output_dir, exist_ok=True)
            log = os.path.join(args.output_dir, f"overhead-serve-{stamp()}.log")
            served_runs = served(args, model, batches, vocab, log)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    ratios = {}
    for batch in batches:
        on = [r for r in runs if r["batch_size"] == batch and r["progress_bar"]]
        off = [r for r in runs if r["batch_size"] == batch and not r["progress_bar"]]
        if on and off:
            ratios[str(batch)] = on[0]["step_us"] / off[0]["step_us"]
    result = {**run_metadata(), "bench": "overhead", "model": args.model or "nano (1 layer, hidden 64, random)",
              "vocab_size": args.vocab_size if args.model is None else None, "num_threads": args.num_threads,
              "prompt_len": args.prompt_len, "steps": args.steps, "clock": args.clock, "repeats": args.repeats,
              "batch_sizes": batches,
              "phases": list(PHASES),
              "runs": runs, "bar_over_no_bar": ratios, "served": served_runs}
    write_result(args.output_dir, f"overhead-{stamp()}", result, _plot(runs))
    return result


def _plot(runs: list[dict]):
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(runs) + 1.2))
    labels = [f"batch {r['batch_size']}, bar {'on' if r['progress_bar'] else 'off'}" for r in runs]
    left = [0.0] * len(runs)
    for phase in PHASES:
        vals = [r["phases_us_per_seq"][phase] for r in runs]
        ax.barh(labels, vals, left=left, label=phase)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("host µs per sequence per decode step (timed run)")
    ax.set_title("decode step of a near-zero-compute model, by phase", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="x", alpha=0.3)
    return fig
