"""Perplexity of a text as llama.cpp's ``llama-perplexity`` computes it, so that the two engines can be
compared on the same GGUF file and the same text file (an outside referee for our GGUF paths).

The method of ``llama-perplexity -m FILE -f TEXT -c CTX`` (llama.cpp ``tools/perplexity/perplexity.cpp``,
function ``perplexity``), followed step by step:

1. the whole text is tokenized once, with a BOS token in front when the vocabulary adds one
   (``--add-bos auto``: the GGUF key ``tokenizer.ggml.add_bos_token``, else whether the tokenizer adds
   one); no special-token parsing (text that spells ``<|im_start|>`` stays text);
2. the ids are cut into ``len(ids) // CTX`` windows of ``CTX`` consecutive tokens (the tail is dropped),
   the first ``--chunks`` of them when given;
3. each window is evaluated on its own, from an empty cache, with its first token replaced by BOS
   when the vocabulary adds one;
4. only the second half of a window is scored: with ``first = CTX // 2``, the logits at positions
   ``first .. CTX - 2`` predict tokens ``first + 1 .. CTX - 1`` (``CTX - 1 - first`` tokens a window);
5. PPL = exp(mean NLL over all scored tokens); the "+/-" is llama.cpp's estimate,
   ``sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1)) * PPL``.

Here a window is a request's prompt (``prompt_token_ids``, one output token) and the NLL of token i is
``-prompt_logprobs[i][id_i]`` (log-softmax of the float32 logits). ``--gguf-blocks`` picks the path
of a GGUF file's quantized weights: ``auto`` (the loader's choice: blocks on our kernels only for files
of 1 GiB or more dequantized), ``on`` (blocks whatever the size) or ``off``
(``PAGEDLLM_CPU_GGUF_KERNELS=0``: dequantized at load). ``--greedy-tokens N`` also compares the greedy
ids of the quantization bench's chat prompts between ``on`` and ``off`` (first differing position).

    python -c "import sys; t = open(sys.argv[1]).read(); open(sys.argv[2], 'w').write(t[int(len(t) * 0.9):])" \\
        ../shared/data/tinyshakespeare.txt /tmp/heldout.txt
    pagedllm bench perplexity --model smollm2-Q4_K_M.gguf --text /tmp/heldout.txt --ctx 512 --chunks 20
    llama-perplexity -m smollm2-Q4_K_M.gguf -f /tmp/heldout.txt -c 512 --chunks 20 -t 2    # the referee
"""
from __future__ import annotations

import argparse
import gc
import math
import os
from typing import Optional

from pagedllm import envs
from pagedllm.benchmarks.common import run_metadata, write_result
from pagedllm.benchmarks.greedy import first_difference, greedy_outputs
from pagedllm.sampling_params import SamplingParams


def token_nlls(llm, windows: list[list[int]], score_from: int = 1) -> list[float]:
    """Negative log-likelihood (nats, float) of each token at positions ``score_from ..`` of each
    window given the tokens before it in that window, from ``prompt_logprobs``; windows in order,
    positions in order. ``score_from`` >= 1 (position 0 has no context)."""
    if score_from < 1:
        raise ValueError(f"score_from must be >= 1, got {score_from}")
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False)
    return [-out.prompt_logprobs[pos][w[pos]].logprob
            for w, out in zip(windows, outs) for pos in range(score_from, len(w))]


def gguf_add_bos(path: str) -> Optional[bool]:
    """The GGUF key ``tokenizer.ggml.add_bos_token`` of ``path``; None when absent or not a GGUF file."""
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        return None
    from gguf import GGUFReader  # lazily: gguf, only for GGUF files

    field = GGUFReader(path).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.contents())


def llama_windows(ids: list[int], ctx: int, bos: Optional[int], chunks: Optional[int] = None) -> list[list[int]]:
    """llama-perplexity's windows: ``ids`` (already with the leading BOS where the vocabulary adds one)
    cut into ``len(ids) // ctx`` windows of ``ctx`` (at most ``chunks``), the first token of each
    replaced by ``bos`` unless it is None. Raises ValueError when not even one window fits."""
    n = len(ids) // ctx
    if chunks is not None:
        n = min(n, chunks)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
    windows = [ids[i * ctx:(i + 1) * ctx] for i in range(n)]
    if bos is not None:
        for w in windows:
            w[0] = bos
    return windows


def llama_perplexity(nlls: list[float]) -> tuple[float, float]:
    """(PPL, its +/- as llama-perplexity prints them) of the scored tokens' NLLs."""
    count = len(nlls)
    mean = sum(nlls) / count
    var = sum(x * x for x in nlls) / count - mean * mean
    ppl = math.exp(mean)
    return ppl, (math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0)


def tokenize_text(tokenizer, text: str, add_bos: bool) -> list[int]:
    """The text's ids without special-token handling, BOS in front when ``add_bos``. Raises ValueError
    when BOS is asked for and the tokenizer has none."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if add_bos:
        if tokenizer.bos_token_id is None:
            raise ValueError("the vocabulary adds BOS but the tokenizer has no bos_token_id")
        ids = [tokenizer.bos_token_id] + ids
    return ids


def resolve_add_bos(choice: str, model: str, tokenizer) -> bool:
    """``--add-bos``: yes / no, or auto (the GGUF key, else whether ``tokenizer`` puts BOS in front)."""
    if choice != "auto":
        return choice == "yes"
    key = gguf_add_bos(model)
    if key is not None:
        return key
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a")[:1] == [bos]


def _load(a: argparse.Namespace, blocks: str, kernels_env: Optional[str]):
    """LLM of ``a.model`` with the GGUF blocks path ``blocks`` (auto keeps the caller's
    ``PAGEDLLM_CPU_GGUF_KERNELS``, ``kernels_env``)."""
    from pagedllm.llm import LLM  # lazily: the engine
    from pagedllm.models import loader  # lazily: the engine

    envs.set_raw("PAGEDLLM_CPU_GGUF_KERNELS", kernels_env if blocks == "auto" else "0" if blocks == "off" else "1")
    saved = loader.GGUF_BLOCKS_MIN_FLOAT_BYTES
    if blocks == "on":
        loader.GGUF_BLOCKS_MIN_FLOAT_BYTES = 0
    try:
        return LLM(a.model, tokenizer=a.tokenizer, dtype=a.dtype, max_model_len=a.ctx + 8,
                   max_num_batched_tokens=a.ctx + 8, kv_cache_memory=a.kv_cache_memory)
    finally:
        loader.GGUF_BLOCKS_MIN_FLOAT_BYTES = saved


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="GGUF file or model folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    p.add_argument("--text", required=True, help="plain-text file (llama-perplexity's -f)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (llama-perplexity's -c)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many windows (llama-perplexity's "
                                                            "--chunks; default: all)")
    p.add_argument("--add-bos", default="auto", choices=["auto", "yes", "no"],
                   help="BOS in front of the text and of every window")
    p.add_argument("--gguf-blocks", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                   help="path(s) of a GGUF file's quantized weights, each run in turn")
    p.add_argument("--greedy-tokens", type=int, default=0,
                   help="also compare greedy ids of the chat prompts, blocks on vs off, for this many tokens")
    p.add_argument("--dtype", default="float32", help="activation dtype")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes")
    p.add_argument("--output-dir", default="bench_results")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> dict:
    if not os.path.isfile(a.text):
        raise SystemExit(f"pagedllm bench perplexity: error: no text file at {a.text!r}")
    if a.ctx < 4:
        raise SystemExit(f"pagedllm bench perplexity: error: --ctx must be at least 4, got {a.ctx}")

    with open(a.text) as f:
        text = f.read()
    result: dict = {"meta": run_metadata(), "model": a.model, "text": a.text, "ctx": a.ctx, "runs": {}}
    windows = None
    greedy: dict[str, list[list[int]]] = {}
    paths = list(dict.fromkeys(a.gguf_blocks + (["on", "off"] if a.greedy_tokens else [])))
    kernels_env = envs.raw("PAGEDLLM_CPU_GGUF_KERNELS")
    for blocks in paths:
        llm = _load(a, blocks, kernels_env)
        if windows is None:
            tok = llm.get_tokenizer()
            add_bos = resolve_add_bos(a.add_bos, a.model, tok)
            ids = tokenize_text(tok, text, add_bos)
            windows = llama_windows(ids, a.ctx, tok.bos_token_id if add_bos else None, a.chunks)
            result.update(tokens=len(ids), add_bos=add_bos, windows=len(windows))
            print(f"{len(ids)} tokens (BOS {'added' if add_bos else 'not added'}), {len(windows)} windows of "
                  f"{a.ctx}, {a.ctx - 1 - a.ctx // 2} scored a window", flush=True)
        if blocks in a.gguf_blocks:
            ppl, err = llama_perplexity(token_nlls(llm, windows, a.ctx // 2 + 1))
            result["runs"][blocks] = {"perplexity": ppl, "plus_minus": err,
                                      "scored_tokens": len(windows) * (a.ctx - 1 - a.ctx // 2)}
            print(f"gguf blocks {blocks}: PPL = {ppl:.4f} +/- {err:.5f}", flush=True)
        if a.greedy_tokens:
            greedy[blocks] = greedy_outputs(llm, a.greedy_tokens)
        del llm
        gc.collect()
    if a.greedy_tokens:
        firsts = [first_difference(x, y) for x, y in zip(greedy["on"], greedy["off"])]
        same = sum(f == a.greedy_tokens for f in firsts)
        result["greedy"] = {"tokens": a.greedy_tokens, "first_difference": firsts, "identical": same,
                            "on": greedy["on"], "off": greedy["off"]}
        print(f"greedy, blocks on vs off: {same}/{len(firsts)} prompts identical for {a.greedy_tokens} tokens; "
              f"first differences {firsts}", flush=True)
    write_result(a.output_dir, "perplexity", result)
    return result
