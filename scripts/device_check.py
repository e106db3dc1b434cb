"""The measurements of ``scripts/device_check.sh`` on a lent GPU (issue 38's targets), and a ``--dry-run`` of them
on the CPU.

1. Greedy equality: tiny random checkpoints of three families (Llama, Qwen2, Gemma 2: soft-caps and
   sliding windows) generate the same token ids through ``--attention-backend triton`` as through the
   torch reference (float32, so rounding cannot flip a tie).
2. A table for dummy-weight (``--load-format dummy``) Qwen2-0.5B and Llama-3-8B shapes in bf16
   (``pagedllm/benchmarks/model_shapes.py``): batch-1 ms per output token against the HBM floor, output
   tok/s at batch 64 and 256 (prefill included), CUDA graphs on and off, the torch backend beside it.

The HBM floor of one decode step at batch 1 is the bytes it must read over the device's bandwidth:
every weight but an untied input embedding (a step reads one row of it) plus the K/V of the context so
far, ``(weights + kv_bytes_per_token * context) / bandwidth``; the bandwidth is measured here, with a
device-to-device copy (bytes read + written over its time).

    python scripts/device_check.py                   # on a GPU (device_check.sh runs it)
    python scripts/device_check.py --dry-run         # on the CPU: demo model, tiny shapes, torch backend
    python scripts/device_check.py --json out.json   # also write the rows as JSON
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pagedllm import LLM, SamplingParams  # noqa: E402  (after the path: run from a checkout)
from pagedllm.benchmarks.model_shapes import write_model_shape  # noqa: E402
from pagedllm.config import DEMO_MODEL_PATH  # noqa: E402
from pagedllm.layers.attention.selector import get_attention_backend  # noqa: E402

BASELINE_TOK_S = 902.0  # Qwen2-0.5B shape, batch 256, torch backend, on an H200 before issue 38
FAMILIES = ("llama", "qwen2", "gemma2")


# ---- arguments ----------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU: the demo model and the llama-tiny shape, torch backend, small batches")
    # (a shape "demo" is the bundled demo model with its own weights)
    p.add_argument("--shapes", default=None,
                   help="comma-separated model shapes (default: qwen2-0.5b,llama-3-8b; dry run: llama-tiny)")
    p.add_argument("--backends", default=None, help="comma-separated attention backends (default: triton,torch; "
                                                    "dry run: torch)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes for tok/s (default: 64,256; "
                                                   "dry run: 2,4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; dry run 8)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens a request (default 64; dry run 4)")
    p.add_argument("--b1-tokens", type=int, default=None,
                   help="tokens timed at batch 1 (default 128; dry run 8)")
    p.add_argument("--skip-equality", action="store_true", help="skip the greedy-equality check")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds; configurations not started by then are skipped (and listed)")
    p.add_argument("--json", default=None, help="write the rows and checks as JSON here")
    a = p.parse_args(argv)
    dry = a.dry_run
    a.shapes = _csv(a.shapes, "demo,llama-tiny" if dry else "qwen2-0.5b,llama-3-8b")
    a.backends = _csv(a.backends, "torch" if dry else "triton,torch")
    a.batches = [int(b) for b in _csv(a.batches, "2,4" if dry else "64,256")]
    a.prompt_len = a.prompt_len or (8 if dry else 64)
    a.output_len = a.output_len or (4 if dry else 64)
    a.b1_tokens = a.b1_tokens or (8 if dry else 128)
    a.device = "cpu" if dry else "cuda"
    a.dtype = "float32" if dry else "bfloat16"
    if any(b < 1 for b in a.batches) or min(a.prompt_len, a.output_len, a.b1_tokens) < 1:
        p.error("batch sizes and lengths must be >= 1")
    return a


def _csv(value: Optional[str], default: str) -> list[str]:
    return [x.strip() for x in (value or default).split(",") if x.strip()]


# ---- the floor ----------------------------------------------------------------------------------
def step_weight_bytes(weight_bytes: int, vocab_size: int, hidden_size: int, tied: bool, dtype_bytes: int) -> int:
    """Weight bytes a decode step reads: all of them but an untied input embedding (one row of it is read;
    a tied one is the LM head, which is read whole)."""
    return weight_bytes - (0 if tied else vocab_size * hidden_size * dtype_bytes)


def hbm_floor_ms(weight_bytes: int, kv_bytes_per_token: int, context: int, bandwidth: float) -> float:
    """ms per output token at batch 1 if the step only moved its bytes at ``bandwidth`` (bytes/s): the
    weights it reads plus the K/V of ``context`` tokens."""
    return 1e3 * (weight_bytes + kv_bytes_per_token * context) / bandwidth


def measure_bandwidth(device: str, nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + written), the mean of ``iters`` after two warm-ups."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    return 2 * src.numel() * iters / (time.perf_counter() - t0)


# ---- the table ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    shape: str
    backend: str
    graphs: str  # "on", "off", "off (why)"
    b1_ms: Optional[float] = None
    floor_ms: Optional[float] = None
    tok_s: dict = dataclasses.field(default_factory=dict)  # batch -> output tok/s
    error: str = ""

    @property
    def x_floor(self) -> Optional[float]:
        return self.b1_ms / self.floor_ms if self.b1_ms and self.floor_ms else None


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(rows: list[Row], batches: list[int]) -> str:
    """A fixed-width text table of ``rows``, one line each (an error row: what failed, past its third column)."""
    head = ["shape", "backend", "graphs", "b1 ms/tok", "floor ms", "x floor", *[f"tok/s b{b}" for b in batches]]
    body = [[r.shape, r.backend, r.graphs, f"error: {r.error}"] if r.error else
            [r.shape, r.backend, r.graphs, _num(r.b1_ms, ".2f"), _num(r.floor_ms, ".3f"), _num(r.x_floor, ".2f"),
             *[_num(r.tok_s.get(b), ".0f") for b in batches]] for r in rows]
    full = [head, *(c for c in body if len(c) == len(head))]
    widths = [max(len(c[i]) for c in ([head, *body] if i < 3 else full)) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        if len(cells) != len(head):
            return "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells[:3])) + "  " + cells[3]
        return "  ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(cells)).rstrip()

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *(line(c) for c in body)])


# ---- running the engine -------------------------------------------------------------------------
def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lo = min(100, vocab // 2)  # away from the special ids at the bottom of most vocabularies
    return [{"prompt_token_ids": torch.randint(lo, vocab, (length,), generator=g).tolist()} for _ in range(n)]


def _timed(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _free(llm: Optional[LLM]) -> None:
    if llm is not None:
        llm.llm_engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(llm: LLM, args: argparse.Namespace, vocab: int, seed: int) -> tuple[float, dict]:
    """(batch-1 ms per output token, {batch: output tok/s}) of an engine already warmed up."""
    one = _prompts(1, args.prompt_len, vocab, seed)
    t_first = _timed(llm, one, 1)  # prefill + the first token
    t_all = _timed(llm, _prompts(1, args.prompt_len, vocab, seed + 1), args.b1_tokens + 1)
    b1_ms = 1e3 * max(t_all - t_first, 0.0) / args.b1_tokens
    tok_s = {}
    for b in args.batches:
        t = _timed(llm, _prompts(b, args.prompt_len, vocab, seed + 2 + b), args.output_len)
        tok_s[b] = b * args.output_len / t
    return b1_ms, tok_s


def use_backend(llm: LLM, name: str) -> None:
    """Point every attention layer of ``llm``'s model at backend ``name`` (the same weights, so a large
    shape is loaded once for all backends), drop the graphs (captured with the old backend) and zero the
    KV cache (a backend that gathers padded slots needs finite values there). For shapes without sliding
    windows (a windowed layer's wrapper, ``SlidingWindowBackend``, would be replaced too)."""
    engine = llm.llm_engine
    mc, runner = engine.config.model_config, engine.executor.runner
    backend = get_attention_backend(name, device=engine.config.device, dtype=mc.dtype, head_dim=mc.head_dim,
                                    block_size=engine.config.cache_config.block_size)
    for layer in runner.model.layers:
        layer.self_attn.backend = backend
    runner.attention_backend, runner.cuda_graphs = backend, None
    runner.graphs_off = f"attention backend {name!r} swapped in"
    for cache in runner.kv_caches:
        if cache is not None:
            cache.zero_()


def run_shape(shape: str, path: str, args: argparse.Namespace, bandwidth: float, deadline: float) -> list[Row]:
    """The rows of one shape, one engine: the first backend of ``args.backends`` with CUDA graphs on, then
    off (the same engine with its graphs dropped, as --enforce-eager runs), then each other backend
    swapped in (``use_backend``), eagerly. An engine without graphs gives one row per backend."""
    llm, rows = None, []
    first, *others = args.backends
    try:
        llm = LLM(path, load_format="auto" if shape == "demo" else "dummy", dtype=args.dtype, device=args.device,
                  attention_backend=first, max_num_seqs=max(args.batches),
                  max_model_len=args.prompt_len + max(args.output_len, args.b1_tokens) + 16, enable_prefix_caching=False,
                  kv_cache_memory=(64 << 20) if args.device == "cpu" else (8 << 30))
    except Exception as e:  # noqa: BLE001 - a backend this checkout lacks or refuses is a row, not a crash
        _free(llm)
        rows.append(Row(shape, first, "-", error=f"{type(e).__name__}: {e}"[:160]))
        if not others:
            return rows
        args = argparse.Namespace(**{**vars(args), "backends": others})
        return rows + run_shape(shape, path, args, bandwidth, deadline)
    try:
        engine = llm.llm_engine
        runner = engine.executor.runner
        hf = engine.config.model_config.hf_config
        dtype_bytes = engine.config.model_config.dtype.itemsize
        weights = step_weight_bytes(engine.executor.weight_bytes(), hf.vocab_size, hf.hidden_size,
                                    bool(getattr(hf, "tie_word_embeddings", False)), dtype_bytes)
        kv_per_token = runner.bytes_per_block() // engine.config.cache_config.block_size
        # the mean context over the timed batch-1 tokens
        floor = hbm_floor_ms(weights, kv_per_token, args.prompt_len + args.b1_tokens // 2, bandwidth)
        graphs = runner.cuda_graphs
        modes = [(first, "on", graphs), (first, "off", None)] if graphs is not None else \
            [(first, f"off ({runner.graphs_off})", None)]
        modes += [(b, "off", None) for b in others]
        warm = None
        for backend, label, g in modes:
            label = label if len(label) < 40 else label[:37] + "..."
            if time.perf_counter() > deadline:
                rows.append(Row(shape, backend, label, error="skipped: over the time budget"))
                continue
            try:
                if backend != first:
                    use_backend(llm, backend)
                runner.cuda_graphs = g
                if warm != backend:  # Triton compiles and autotunes on first use
                    _timed(llm, _prompts(min(8, max(args.batches)), args.prompt_len, hf.vocab_size, 0), 4)
                    warm = backend
                b1, tok_s = measure(llm, args, hf.vocab_size, 1)
                rows.append(Row(shape, backend, label, b1, floor, tok_s))
            except Exception as e:  # noqa: BLE001 - one failing configuration is a row, not a crash
                rows.append(Row(shape, backend, label, error=f"{type(e).__name__}: {e}"[:160]))
        return rows
    finally:
        _free(llm)


# ---- greedy equality ----------------------------------------------------------------------------
def greedy_equality(device: str, families=FAMILIES, backend: str = "triton") -> dict[str, str]:
    """family -> "equal" or what differed, for ``backend`` against torch on tiny random checkpoints."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import build_checkpoint  # lazily: the tests' tiny-checkpoint builder (tests/ is not a package)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in families:
            extra = dict(head_dim=16, sliding_window=24) if fam == "gemma2" else {}
            path = build_checkpoint(os.path.join(tmp, fam), fam, **extra)
            ids = {}
            for b in ("torch", backend):
                llm = None
                try:
                    llm = LLM(path, dtype="float32", device=device, attention_backend=b, kv_cache_memory=64 << 20,
                              max_model_len=256)
                    prompts = _prompts(4, 40, llm.get_tokenizer().vocab_size, 3) + [{"prompt_token_ids": [5, 6, 7]}]
                    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                        use_tqdm=False)
                    ids[b] = [o.outputs[0].token_ids for o in outs]
                except Exception as e:  # noqa: BLE001 - report, go on with the next family
                    ids[b] = f"{type(e).__name__}: {e}"[:200]
                finally:
                    _free(llm)
            a, c = ids["torch"], ids[backend]
            results[fam] = ("equal" if a == c else c if isinstance(c, str) else a if isinstance(a, str)
                            else f"differ in {sum(x != y for x, y in zip(a, c))} of {len(a)} sequences")
    return results


# ---- main ---------------------------------------------------------------------------------------
def targets(rows: list[Row], equality: dict[str, str]) -> list[tuple[str, Optional[bool], str]]:
    """(target, met? None = not measured, the figure) for issue 38's three targets."""
    out = []
    llama = [r for r in rows if r.shape == "llama-3-8b" and r.backend == "triton" and r.x_floor]
    best = min((r.x_floor for r in llama), default=None)
    out.append(("Llama-3-8B batch-1 decode within 1.3x of the HBM floor", None if best is None else best <= 1.3,
                _num(best, ".2f") + "x"))
    qwen = [r.tok_s.get(256) for r in rows if r.shape == "qwen2-0.5b" and r.backend == "triton" and r.tok_s.get(256)]
    top = max(qwen, default=None)
    out.append((f"Qwen2-0.5B batch 256 >= 10x {BASELINE_TOK_S:.0f} tok/s",
                None if top is None else top >= 10 * BASELINE_TOK_S, _num(top, ".0f") + " tok/s"))
    out.append(("triton greedy ids equal torch's",
                None if not equality else all(v == "equal" for v in equality.values()),
                ", ".join(f"{k}: {v}" for k, v in equality.items()) or "not run"))
    return out


def main(argv: Optional[list[str]] = None, log: Callable[[str], Any] = print) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + args.time_budget
    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device here: run with --dry-run on a CPU")
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    bandwidth = measure_bandwidth(args.device, (2 << 30) if args.device == "cuda" else (256 << 20))
    log(f"device: {name}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    equality: dict[str, str] = {}
    if not args.skip_equality and not args.dry_run:
        equality = greedy_equality(args.device)
        log("greedy equality, triton vs torch: " + ", ".join(f"{k}: {v}" for k, v in equality.items()))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {s: DEMO_MODEL_PATH if s == "demo" else write_model_shape(os.path.join(tmp, s), s) for s in args.shapes}
        for shape in args.shapes:
            if time.perf_counter() > deadline:
                rows.extend(Row(shape, b, "-", error="skipped: over the time budget") for b in args.backends)
                continue
            t = time.perf_counter()
            rows.extend(run_shape(shape, paths[shape], args, bandwidth, deadline))
            log(f"{shape}: {time.perf_counter() - t:.0f} s")
    log("")
    log(f"{args.dtype}, dummy weights, prompts of {args.prompt_len} tokens; batch 1: {args.b1_tokens} tokens timed; "
        f"tok/s: {args.output_len} output tokens a request, prefill included")
    log(format_table(rows, args.batches))
    checks = targets(rows, equality)
    log("")
    for what, ok, figure in checks:
        log(f"{'PASS' if ok else 'FAIL' if ok is False else 'n/a '}  {what}: {figure}")
    log(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "bandwidth": bandwidth, "equality": equality,
                       "rows": [dataclasses.asdict(r) | {"x_floor": r.x_floor} for r in rows],
                       "targets": [dict(target=w, met=ok, figure=fig) for w, ok, fig in checks]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
