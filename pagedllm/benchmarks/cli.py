"""``pagedllm bench <command>``: one subcommand per entry of ``COMMANDS`` below.

``pagedllm/entrypoints/cli.py`` calls ``register_subparser``; ``python -m pagedllm.benchmarks.cli``
runs the same commands without it.
"""
from __future__ import annotations

import argparse
import importlib
import re
from typing import Optional

# subcommand -> (module, one-line help)
COMMANDS = {
    "throughput": ("pagedllm.benchmarks.throughput",
                   "offline throughput of pagedllm vs transformers (static batching, continuous batching)"),
    "serve": ("pagedllm.benchmarks.serve",
              "online streaming client for any OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput"),
    "memory": ("pagedllm.benchmarks.memory",
               "KV-cache memory efficiency: paged cache vs contiguous per-request preallocation"),
    "profile": ("pagedllm.benchmarks.profile", "where the time of one decode step goes"),
    "matmul": ("pagedllm.benchmarks.matmul", "float32 vs bfloat16 linear layers at decode shapes on this CPU"),
    "prefix-caching": ("pagedllm.benchmarks.prefix_caching",
                       "shared-prefix workload: TTFT and throughput with prefix caching on vs off"),
    "image": ("pagedllm.benchmarks.image",
              "image workload (a question + a 448x448 picture per request): TTFT and throughput with the "
              "encoder cache on vs off"),
    "quantization": ("pagedllm.benchmarks.quantization",
                     "int8 (W8A8) vs fp32: held-out perplexity, greedy agreement, matmul speed, throughput"),
    "overhead": ("pagedllm.benchmarks.overhead",
                 "host time of a decode step by phase, with a near-zero-compute model (batch 1 to 1,024)"),
    "speculative": ("pagedllm.benchmarks.speculative",
                    "speculative decoding (ngram, draft_model) on vs off: tok/s and acceptance length by batch size"),
    "gguf-decode": ("pagedllm.benchmarks.gguf_decode",
                    "batch-1 decode of a random GGUF of a real shape: blocks on our kernels vs dequantized, "
                    "with the memory floor"),
    "perplexity": ("pagedllm.benchmarks.perplexity",
                   "perplexity of a text as llama.cpp's llama-perplexity computes it (windows of --ctx, second "
                   "half scored), GGUF blocks on/off; greedy ids blocks vs dequantized"),
    "lora": ("pagedllm.benchmarks.lora", "LoRA adapters: w48 throughput with 1/4/16 adapters vs the base model; "
                                         "the batched op grouped vs bmm"),
}


def register_subparser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` (with its subcommands) to a parent CLI's ``add_subparsers()`` object. Every
    leaf parser sets ``func`` (called with the parsed args)."""
    bench = subparsers.add_parser("bench", help="benchmarks (" + ", ".join(COMMANDS) + ")",
                                  description="Benchmarks. Each run writes a JSON result and a PNG plot into "
                                              "--output-dir (default bench_results/).")
    sub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(COMMANDS) + "}")
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=plain_text(mod.__doc__ or ""),
                           formatter_class=BenchHelpFormatter)
        mod.add_args(p)
        for action in p._actions:  # an option without help still shows its default
            if action.help is None and action.option_strings and action.default not in (None, argparse.SUPPRESS):
                action.help = "default: %(default)s"
    return bench


_MARKUP = re.compile(r"``(.+?)``|:\w+:`(.+?)`|`([^`]+?)`_{0,2}")


def plain_text(text: str) -> str:
    """reST markup of a docstring as plain terminal text: ``x`` and :role:`x` become x."""
    return _MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), text)


class BenchHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain-text help: the module docstring's paragraphs as written (markup removed) and every
    option's default (unless its help already states one)."""

    def _get_help_string(self, action):
        help_ = plain_text(action.help or "")
        if "default" in help_ or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return help_
        if isinstance(action, argparse._StoreConstAction) and action.default is False:
            return help_  # a store_true flag: off unless given
        return help_ + " (default: %(default)s)"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm")
    register_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
