"""Seeded synthetic workloads. Prompts are token-id lists (any tokenizer/vocabulary works) and
every request has a target output length, enforced with ``ignore_eos`` / no EOS, so that every
backend does exactly the same work.

- ``random``: every prompt has ``--input-len`` tokens and every output ``--output-len`` tokens.
- ``sharegpt-like``: mixed lengths. Prompt and output lengths are drawn independently from
  log-normal distributions whose medians are ``--input-len`` / ``--output-len`` and whose
  log-standard-deviation is ``--len-sigma``, rounded and clipped to
  [``--input-min``, ``--input-max``] / [``--output-min``, ``--output-max``]. ShareGPT's lengths
  are heavy-tailed like this (the vLLM paper, fig. 11); the defaults are scaled down for CPUs.

Token ids are uniform over the vocabulary minus the tokenizer's special tokens, so prompts share
no prefix (prefix caching cannot help any backend).
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from typing import Iterable

DATASETS = ("random", "sharegpt-like")


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
                   help="random: fixed lengths; sharegpt-like: log-normal mixed lengths (default)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", type=int, default=input_len, help="prompt length (median for sharegpt-like)")
    g.add_argument("--output-len", type=int, default=output_len, help="output length (median for sharegpt-like)")
    g.add_argument("--input-min", type=int, default=None, help="sharegpt-like clip (default input-len / 4)")
    g.add_argument("--input-max", type=int, default=None, help="sharegpt-like clip (default input-len * 4)")
    g.add_argument("--output-min", type=int, default=None, help="sharegpt-like clip (default output-len / 4)")
    g.add_argument("--output-max", type=int, default=None, help="sharegpt-like clip (default output-len * 4)")
    g.add_argument("--len-sigma", type=float, default=0.6, help="log-normal sigma of sharegpt-like lengths")
    g.add_argument("--seed", type=int, default=0)


def _lognormal_len(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def sample_requests(args: argparse.Namespace, vocab_size: int,
                    special_ids: Iterable[int] = ()) -> list[BenchRequest]:
    """The workload described by ``args`` (see ``add_dataset_args``), deterministic in ``args.seed``."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
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
    from pagedllm.benchmarks.common import summarize

    d = {k: getattr(args, k) for k in ("dataset", "num_prompts", "input_len", "output_len", "input_min", "input_max",
                                       "output_min", "output_max", "len_sigma", "seed")}
    if args.dataset == "sharegpt-like":
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
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    special: list[int] = []
    try:
        from transformers import AutoTokenizer

        special = list(AutoTokenizer.from_pretrained(model_path).all_special_ids)
    except Exception:  # noqa: BLE001 - no tokenizer: every id is fair game
        pass
    return vocab, special


def to_jsonable(reqs: list[BenchRequest], with_ids: bool = False) -> list[dict]:
    return [asdict(r) if with_ids else {"prompt_len": r.prompt_len, "output_len": r.output_len} for r in reqs]


__all__ = ["BenchRequest", "DATASETS", "add_dataset_args", "sample_requests", "describe", "model_vocab",
           "to_jsonable"]
