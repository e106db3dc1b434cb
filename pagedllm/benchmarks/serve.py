"""Online serving benchmark: a streaming client for any OpenAI-compatible server.

Requests arrive as a Poisson process of ``--request-rate`` requests/s (``inf``: all at once),
at most ``--max-concurrency`` in flight. Each request streams ``/v1/completions`` (or
``/v1/chat/completions`` with ``--endpoint chat``) with ``max_tokens`` = its target output length,
``ignore_eos`` and ``temperature`` 0, so every server does the same work.

Reported (mean / median / p99): TTFT (time to first token), TPOT (time per output token after the
first: (E2E - TTFT) / (tokens - 1)), ITL (inter-token latency: gap between successive streamed
chunks), E2E latency; plus request throughput and output token throughput over the run.
Output tokens are counted from the final ``usage`` chunk (``stream_options.include_usage``) when
the server sends one, else one per streamed chunk that carries text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from pagedllm.benchmarks import datasets as ds
from pagedllm.benchmarks.common import pyplot, run_metadata, stamp, summarize, write_result
from pagedllm.benchmarks.model_shapes import resolve_model


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", required=True, help="model name sent in each request (as the server serves it)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default=None,
                   help="folder whose config/tokenizer give the vocabulary for random prompts (or shape:NAME); "
                        "default: --model if it is a local folder, else --vocab-size")
    p.add_argument("--vocab-size", type=int, default=256, help="fallback vocabulary for prompt token ids")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send token ids (completions only) or text decoded with --tokenizer")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--output-dir", default="bench_results")
    ds.add_dataset_args(p, input_len=128, output_len=64, num_prompts=64)
    p.set_defaults(func=run)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # target (max_tokens)
    success: bool = False
    error: Optional[str] = None
    start_s: float = 0.0  # since the benchmark started
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    usage_reported: bool = False

    @property
    def tpot_s(self) -> Optional[float]:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _payload(args, req: ds.BenchRequest, prompt) -> dict:
    body = {"model": args.model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(obj: dict) -> str:
    parts = []
    for c in obj.get("choices") or []:
        if "text" in c:
            parts.append(c.get("text") or "")
        else:
            parts.append((c.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def _one(client, args, url: str, req: ds.BenchRequest, prompt, t_bench: float) -> RequestResult:
    res = RequestResult(req.prompt_len, req.output_len)
    start = time.perf_counter()
    res.start_s = start - t_bench
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=_payload(args, req, prompt),
                                 headers={"Authorization": f"Bearer {args.api_key}"}) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return res
                now = time.perf_counter()
                # A chunk with choices counts as output even when its text is empty (e.g. a token
                # the tokenizer cannot show yet); the usage-only chunk has no choices.
                if obj.get("choices") and (_chunk_text(obj) or any(
                        c.get("finish_reason") is None for c in obj["choices"])):
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.output_tokens = int(usage["completion_tokens"])
                    res.usage_reported = True
        res.e2e_s = time.perf_counter() - start
        if not res.usage_reported:
            res.output_tokens = chunks
        res.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is recorded, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run_async(args, reqs: list[ds.BenchRequest], prompts: list) -> tuple[list[RequestResult], float]:
    import httpx  # lazily: httpx is optional (pagedllm[bench]); run() says so when it is missing

    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=args.max_concurrency or len(reqs) + 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def guarded(req, prompt):
            if sem is None:
                return await _one(client, args, url, req, prompt, t0)
            async with sem:
                return await _one(client, args, url, req, prompt, t0)

        tasks = []
        for req, prompt in zip(reqs, prompts):
            tasks.append(asyncio.create_task(guarded(req, prompt)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _vocab(args) -> tuple[int, list[int], Optional[object]]:
    path = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    if path:
        path, _ = resolve_model(path, "auto", args.output_dir)
        vocab, special = ds.model_vocab(path)
        tok = None
        if args.prompt_format == "text":
            from transformers import AutoTokenizer  # lazily: transformers, ~1 s to import

            tok = AutoTokenizer.from_pretrained(path)
            vocab = min(vocab, len(tok))
        return vocab, special, tok
    if args.prompt_format == "text":
        raise ValueError("--prompt-format text needs --tokenizer")
    return args.vocab_size, [], None


def _plot(results: list[RequestResult], title: str):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    ok = [r for r in results if r.success]
    for ax, (name, vals) in zip(axes, [
            ("TTFT (ms)", [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
            ("TPOT (ms)", [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
            ("E2E latency (s)", [r.e2e_s for r in ok if r.e2e_s is not None])]):
        v = sorted(vals)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post")
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return fig


def run(args: argparse.Namespace):
    try:  # lazily: httpx is optional (pagedllm[bench])
        import httpx  # noqa: F401 - the client; not in the base install
    except ImportError:
        print("pagedllm bench serve needs httpx, which the base install does not include: "
              "pip install 'pagedllm[bench]'", file=sys.stderr)
        return 1
    vocab, special, tok = _vocab(args)
    reqs = ds.sample_requests(args, vocab, special)
    if args.prompt_format == "text" or args.endpoint == "chat":
        if tok is None:
            raise ValueError("--endpoint chat and --prompt-format text need --tokenizer (prompts are sent as text)")
        prompts = [tok.decode(r.prompt_token_ids) for r in reqs]
    else:
        prompts = [r.prompt_token_ids for r in reqs]
    results, duration = asyncio.run(_run_async(args, reqs, prompts))
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "total_prompt_tokens": in_tokens, "total_output_tokens": out_tokens,
        "target_output_tokens": sum(r.output_len for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize((r.ttft_s for r in ok), 1000),
        "tpot_ms": summarize((r.tpot_s for r in ok), 1000),
        "itl_ms": summarize((x for r in ok for x in r.itl_s), 1000),
        "e2e_ms": summarize((r.e2e_s for r in ok), 1000),
    }
    errors = [r.error for r in results if r.error]
    print(f"completed {len(ok)}/{len(results)} in {duration:.2f} s: {summary['request_throughput']:.3f} req/s, "
          f"{summary['output_throughput']:.1f} output tok/s")
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[k]
        print(f"  {k:8s} mean {s['mean']:9.1f}  median {s['median']:9.1f}  p99 {s['p99']:9.1f}")
    if errors:
        print(f"first error: {errors[0]}")
    out = {**run_metadata(), "bench": "serve", "base_url": args.base_url, "model": args.model,
           "endpoint": args.endpoint, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
           "workload": ds.describe(args, reqs), **summary, "errors": errors[:20],
           "per_request": [{**{k: v for k, v in asdict(r).items() if k != "itl_s"}, "tpot_s": r.tpot_s,
                            "itl_s": [round(x, 6) for x in r.itl_s]} for r in results]}
    title = (f"{args.model} @ {args.base_url}: {len(results)} requests, rate {args.request_rate}/s, "
             f"concurrency {args.max_concurrency or 'unbounded'}")
    write_result(args.output_dir, f"serve-{stamp()}", out, _plot(results, title))
    return out
