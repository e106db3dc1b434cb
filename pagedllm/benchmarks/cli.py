"""``pagedllm bench {throughput,serve,memory,profile,prefix-caching,quantization}``.

``pagedllm/entrypoints/cli.py`` calls ``register_subparser``; ``python -m pagedllm.benchmarks.cli``
runs the same commands without it.
"""
from __future__ import annotations

import argparse
import importlib
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
    "prefix-caching": ("pagedllm.benchmarks.prefix_caching",
                       "shared-prefix workload: TTFT and throughput with prefix caching on vs off"),
    "quantization": ("pagedllm.benchmarks.quantization",
                     "int8 (W8A8) vs fp32: held-out perplexity, greedy agreement, matmul speed, throughput"),
}


def register_subparser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` (with its subcommands) to a parent CLI's ``add_subparsers()`` object. Every
    leaf parser sets ``func`` (called with the parsed args)."""
    bench = subparsers.add_parser("bench", help="benchmarks (throughput, serve, memory, profile, prefix-caching)",
                                  description="Benchmarks. Each run writes a JSON result and a PNG plot into "
                                              "--output-dir (default bench_results/).")
    sub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(COMMANDS) + "}")
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
    return bench


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm")
    register_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
