"""The ``pagedllm`` command: ``pagedllm serve [MODEL] ...`` (and ``pagedllm bench ...`` when the
benchmarks package is installed). The options come from ``EngineArgs`` and ``ServerArgs``
(``pagedllm/engine/arg_utils.py``); the server itself is imported only in the handler."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from pagedllm import __version__
from pagedllm.benchmarks import cli as bench_cli
from pagedllm.engine import vllm_compat
from pagedllm.engine.arg_utils import EngineArgs, ServerArgs
from pagedllm.logger import init_logger


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already explains it."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server  # lazily: FastAPI loads for this command only

    return run_server(args)


def _run_batch(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.run_batch import run_batch  # lazily: FastAPI loads for this command only

    return run_batch(args)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible API server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models, /health, /version, "
                    "/metrics, /tokenize, /detokenize, /dashboard).",
        formatter_class=_HelpFormatter)
    add_server_args(p)
    p.set_defaults(func=_serve)
    return p


def add_run_batch_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run-batch", help="run a file of OpenAI Batch API requests offline",
        description="Run OpenAI Batch API requests (JSONL: custom_id, method, url, body; url /v1/chat/completions, "
                    "/v1/completions or /v1/embeddings) through the server's handlers without a server, and write "
                    "one result line per request, in input order (vLLM's run-batch). Takes serve's model and "
                    "engine options.", formatter_class=_HelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, help="where the results go ('-': stdout)")
    add_server_args(p)
    p.set_defaults(func=_run_batch)
    return p


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The model, engine and server options of ``serve`` (``run-batch`` takes them too), made from the fields
    of ``EngineArgs`` and ``ServerArgs`` (``pagedllm/engine/arg_utils.py``): a new option is a field there."""
    EngineArgs.add_cli_args(p.add_argument_group("model and engine (the settings of LLM(...))"))
    ServerArgs.add_cli_args(p.add_argument_group("server"))
    vllm_compat.add_vllm_args(p)  # vLLM's other `vllm serve` flags: applied, ignored with a warning, or refused


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", formatter_class=_HelpFormatter,
        description="pagedllm: LLM inference and serving with PagedAttention and continuous batching.")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_parser(subparsers)
    add_run_batch_parser(subparsers)
    bench_cli.register_subparser(subparsers)
    return parser


def _vllm_flags(args: argparse.Namespace) -> int:
    """Start-up check of the vLLM flags given (``vllm_compat.check``): 0, or 2 after the error line."""
    try:
        warning = vllm_compat.check(args)
    except ValueError as e:
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    if warning:
        init_logger(args.log_level.upper()).warning(warning)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    try:
        argv = vllm_compat.normalize_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if args.command in ("serve", "run-batch") and _vllm_flags(args):
        return 2
    rc = args.func(args)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
