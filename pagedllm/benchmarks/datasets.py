"""Seeded synthetic workloads. Prompts are token-id lists (any tokenizer/vocabulary works) and
every request has a target output length, enforced with ``ignore_eos`` / no EOS, so that every
backend does exactly the same work.

- ``random``: every prompt has ``--input-len`` tokens and every output ``--output-len`` tokens.
- ``sharegpt-like``: mixed lengths. Prompt and output lengths are drawn independently from
  log-normal distributions whose medians are ``--input-len`` / ``--output-len`` and whose
  log-standard-deviation is ``--len-sigma``, rounded and clipped to
  [``--input-min``, ``--input-max``] / [``--output-min``, ``--output-max``]. ShareGPT's lengths
  are heavy-tailed like this (the vLLM paper, fig. 11); the defaults are scaled down for CPUs.
- ``w48``: the CPU comparison workload of issue 10 (pagedllm vs llama.cpp's server vs OpenVINO
  GenAI): by default 48 requests, seed 11; each request draws, from one ``random.Random(seed)``
  in this order, a prompt length uniform in [16, 256], that many token ids uniform in
  [10, vocab - 10), and an output length uniform in [16, 128]. Special tokens are not excluded, so
  the requests are exactly those of the ``workload(48, vocab, 11)`` that the side-by-side client
  and the OpenVINO anchor script draw (``benchmarks/README.md``; ``tests/test_bench_w48.py``
  checks it). ``--input-len``/``--output-len`` and the clips do not apply to it.

Token ids are uniform over the vocabulary minus the tokenizer's special tokens, so prompts share
no prefix (prefix caching cannot help any backend).
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from typing import Iterable

from pagedllm.benchmarks.common import summarize

DATASETS = ("random", "sharegpt-like", "w48")
# Per-dataset defaults of --num-prompts and --seed (when not given on the command line).
_DATASET_DEFAULTS = {"w48": {"num_prompts": 48, "seed": 11}}
W48_PROMPT_LEN = (16, 256)
W48_OUTPUT_LEN = (16, 128)
W48_ID_MARGIN = 10  # ids drawn from [10, vocab - 10)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def add_dataset_args(p: argparse.ArgumentParser, input_len: int = 128, output_len: int = 64,
                     num_prompts: int = 64) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="sharegpt-like",
                   help="random: fixed lengths; sharegpt-like: log-normal mixed lengths (default); w48: the CPU "
                        "comparison workload (48 requests, prompts 16-256 ids, outputs 16-128, seed 11)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"number of requests (default: {num_prompts}; 48 for w48)")
    g.add_argument("--input-len", type=int, default=input_len, help="prompt length (median for sharegpt-like)")
    g.add_argument("--output-len", type=int, default=output_len, help="output length (median for sharegpt-like)")
    g.add_argument("--input-min", type=int, default=None, help="sharegpt-like clip (default input-len / 4)")
    g.add_argument("--input-max", type=int, default=None, help="sharegpt-like clip (default input-len * 4)")
    g.add_argument("--output-min", type=int, default=None, help="sharegpt-like clip (default output-len / 4)")
    g.add_argument("--output-max", type=int, default=None, help="sharegpt-like clip (default output-len * 4)")
    g.add_argument("--len-sigma", type=float, default=0.6, help="log-normal sigma of sharegpt-like lengths")
    g.add_argument("--seed", type=int, default=None, help="workload seed (default: 0; 11 for w48)")
    p.set_defaults(default_num_prompts=num_prompts)


def _lognormal_len(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def resolve_workload_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--num-prompts``/``--seed`` left unset with the dataset's defaults (in place)."""
    defaults = {"num_prompts": getattr(args, "default_num_prompts", 64), "seed": 0,
                **_DATASET_DEFAULTS.get(args.dataset, {})}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def w48_requests(num_prompts: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """The ``w48`` workload (see the module docstring). Raises ValueError for a vocabulary of 20 or fewer ids."""
    lo, hi = W48_ID_MARGIN, vocab_size - W48_ID_MARGIN
    if hi <= lo:
        raise ValueError(f"the w48 workload draws ids from [10, vocab - 10); vocab {vocab_size} is too small")
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(*W48_PROMPT_LEN)  # drawn before the ids, the ids before the output length
        ids = [rng.randrange(lo, hi) for _ in range(prompt_len)]
        reqs.append(BenchRequest(ids, rng.randint(*W48_OUTPUT_LEN)))
    return reqs


def sample_requests(args: argparse.Namespace, vocab_size: int,
                    special_ids: Iterable[int] = ()) -> list[BenchRequest]:
    """The workload described by ``args`` (see ``add_dataset_args``), deterministic in ``args.seed``."""
    resolve_workload_args(args)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset == "w48":
        return w48_requests(args.num_prompts, vocab_size, args.seed)
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng = random.Random(args.seed)
    special = set(special_ids)
    vocab = [t for t in range(min(vocab_size, 1 << 20)) if t not in special] if special else None

    def token() -> int:
        return vocab[rng.randrange(len(vocab))] if vocab is not None else rng.randrange(vocab_size)

    reqs = []
    for _ in range(args.num_prompts):
        if args.dataset == "random":
            n_in, n_out = args.input_len, args.output_len
        else:
            n_in = _lognormal_len(rng, args.input_len, args.len_sigma, args.input_min or max(1, args.input_len // 4),
                                  args.input_max or args.input_len * 4)
            n_out = _lognormal_len(rng, args.output_len, args.len_sigma,
                                   args.output_min or max(1, args.output_len // 4),
                                   args.output_max or args.output_len * 4)
        reqs.append(BenchRequest([token() for _ in range(n_in)], n_out))
    return reqs


def describe(args: argparse.Namespace, reqs: list[BenchRequest]) -> dict:
    """The workload's parameters and length statistics, for the result file."""
    d = {k: getattr(args, k) for k in ("dataset", "num_prompts", "input_len", "output_len", "input_min", "input_max",
                                       "output_min", "output_max", "len_sigma", "seed")}
    if args.dataset == "w48":
        d["distribution"] = (f"prompt ~ U[{W48_PROMPT_LEN[0]}, {W48_PROMPT_LEN[1]}] ids ~ U[10, vocab - 10); "
                             f"output ~ U[{W48_OUTPUT_LEN[0]}, {W48_OUTPUT_LEN[1]}]; seed {args.seed}")
    elif args.dataset == "sharegpt-like":
        d["distribution"] = (f"prompt ~ round(LogNormal(ln {args.input_len}, {args.len_sigma})) clipped to "
                             f"[{args.input_min or max(1, args.input_len // 4)}, {args.input_max or args.input_len * 4}]"
                             f"; output ~ round(LogNormal(ln {args.output_len}, {args.len_sigma})) clipped to "
                             f"[{args.output_min or max(1, args.output_len // 4)}, "
                             f"{args.output_max or args.output_len * 4}]; seed {args.seed}")
    else:
        d["distribution"] = f"fixed: prompt {args.input_len}, output {args.output_len}"
    d["prompt_len"] = summarize(r.prompt_len for r in reqs)
    d["output_len_stats"] = summarize(r.output_len for r in reqs)
    d["total_prompt_tokens"] = sum(r.prompt_len for r in reqs)
    d["total_output_tokens"] = sum(r.output_len for r in reqs)
    return d


def model_vocab(model_path: str) -> tuple[int, list[int]]:
    """(vocab size of the model's config, special token ids of its tokenizer if it has one)."""
    from transformers import AutoConfig  # lazily: transformers, ~1 s to import

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    special: list[int] = []
    try:
        from transformers import AutoTokenizer  # lazily: transformers, ~1 s to import

        special = list(AutoTokenizer.from_pretrained(model_path).all_special_ids)
    except Exception:  # noqa: BLE001 - no tokenizer: every id is fair game
        pass
    return vocab, special


def to_jsonable(reqs: list[BenchRequest], with_ids: bool = False) -> list[dict]:
    return [asdict(r) if with_ids else {"prompt_len": r.prompt_len, "output_len": r.output_len} for r in reqs]


__all__ = ["BenchRequest", "DATASETS", "add_dataset_args", "resolve_workload_args", "sample_requests",
           "w48_requests", "describe", "model_vocab", "to_jsonable"]
