"""The ``pagedllm`` command: ``pagedllm serve [MODEL] ...`` (and ``pagedllm bench ...`` when the
benchmarks package is installed). Heavy imports (torch, the engine) happen only in the handler."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Optional

_SIZE_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kib": 2 ** 10, "m": 2 ** 20, "mib": 2 ** 20, "g": 2 ** 30,
               "gib": 2 ** 30, "t": 2 ** 40, "tib": 2 ** 40, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9,
               "tb": 10 ** 12}


def parse_size(value: str) -> int:
    """Bytes from '1073741824', '512MiB', '4M', '2G', '1.5GB' (K/M/G/KiB.. binary, KB/MB/GB decimal)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {value!r} (e.g. 1073741824, 512MiB, 2GiB)")
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {value!r}")
    return n


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already explains it."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(args)


def _run_batch(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.run_batch import run_batch

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
    """The model, engine and server options of ``serve`` (``run-batch`` takes them too)."""
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face model folder, GGUF file (or a folder holding one) or hub id; "
                        "omitted = the bundled demo model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env PAGEDLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the MODEL argument)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder, GGUF file or hub id (default: the model's; a GGUF's from its metadata)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight/activation/KV-cache dtype; auto = the checkpoint's on GPU; on a CPU bfloat16 where "
                        "it has native bf16 matmuls (avx512_bf16/amx_bf16), else float32 (default: auto)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"],
                   help="paged-attention backend; auto = the compiled CPU kernel on a CPU when it builds, "
                        "else the pure-PyTorch reference (torch)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV-cache storage; auto = the model's dtype; int8 = int8 values and a float32 scale per "
                        "token and KV head (at head_dim 64: 3.8x the tokens of float32 in the same memory, 1.9x "
                        "bfloat16's)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="device to run on")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs = arrival order; priority = each request's priority field first (lower runs "
                        "first), then arrival; the least urgent running request is the one preempted")
    p.add_argument("--runner", default="generate", choices=["generate", "pooling"],
                   help="generate = text (completions, chat, responses); pooling = an embedding model served on "
                        "/v1/embeddings (each input's last hidden state, L2-normalized)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy = random weights of the model's shape (no weight files needed)")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int8-g64", "none"],
                   help="int8 = W8A8: int8 weights (per output channel) and activations (per token), int32 "
                        "matmuls, after SmoothQuant smoothing calibrated at load (PAGEDLLM_SMOOTHQUANT_ALPHA=0: "
                        "off; then a GGUF file's Q8_0 blocks go straight in); int8-g64: activation scales per "
                        "token and group of 64 features (slower prefill) (default: none)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's max_position_embeddings")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="tensor-parallel ranks: GPUs, or CPU processes (cores split between them)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages (the layers split over processes/GPUs; world size = TP x PP)")
    p.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="how TP/PP worker ranks start: mp = local processes (multi-node: --nnodes), ray = Ray "
                        "actors in a placement group on the running cluster (ray start --head) or a local one")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in a multi-node launch (every node runs "
                   "`pagedllm serve` with the same flags; world size TP x PP split evenly over the nodes)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank; node 0 serves the API")
    p.add_argument("--master-addr", default=None, help="node 0's address, reachable from every node (multi-node)")
    p.add_argument("--master-port", type=int, default=None,
                   help="free port on node 0 for the torch.distributed rendezvous (multi-node)")
    p.add_argument("--headless", action="store_true",
                   help="run this node's worker ranks only (no API server); for nodes with --node-rank >= 1")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas (processes, each with its own model copy, KV cache and cores / N "
                        "threads) behind this one server; requests go to the least-loaded replica")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory (of RAM on a CPU) for weights + activations + KV cache "
                        "(default: 0.9). On a CPU, when neither this nor --kv-cache-memory is given, the KV cache "
                        "has a fixed size instead: 4 GiB, or PAGEDLLM_CPU_KVCACHE_SPACE GiB")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV-cache size in bytes (e.g. 2GiB); overrides --gpu-memory-utilization")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for the model (default: OMP_NUM_THREADS if set, else the physical cores)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="maximum sequences in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: 2048 on a CPU, "
                        "else max(2048, min(max_model_len, 8192)))")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    p.add_argument("--seed", type=int, default=0, help="random seed (weights of --load-format dummy, sampling)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs (top_logprobs on chat) or prompt_logprobs a request may ask for; more "
                        "is refused (400). The default, 20, is OpenAI's cap (default: 20)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (or inline template); default: the tokenizer's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the model's text: hermes, llama3_json, openai (gpt-oss)")
    p.add_argument("--reasoning-parser", default=None,
                   help="split a reasoning model's <think>...</think> into message.reasoning (deepseek_r1: the "
                        "opening tag optional; qwen3: only an output that opens with it); openai_gptoss: gpt-oss's "
                        "analysis channel")
    p.add_argument("--max-request-bytes", type=parse_size, default=4 * 2 ** 20,
                   help="largest accepted request body; bigger ones get 413")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to let in-flight requests finish on SIGINT/SIGTERM before aborting them")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="Responses API: most responses kept for previous_response_id and GET (oldest evicted)")
    p.add_argument("--stored-response-ttl", type=float, default=3600.0,
                   help="Responses API: seconds a stored response is kept")
    p.add_argument("--max-stored-response-bytes", type=parse_size, default=256 * 2 ** 20,
                   help="Responses API: most bytes the stored responses may hold (response objects, input "
                        "items, conversations and background events, as JSON; oldest evicted first); e.g. 256MiB")
    p.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the live block-pool dashboard at /dashboard (--no-dashboard: off)")
    # HTTP limits (uvicorn's names) and CORS (vLLM's flags and defaults)
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open between requests")
    p.add_argument("--timeout-request-read", type=float, default=30.0,
                   help="seconds a client has to send a whole request (headers and body) before its connection "
                        "is closed; 0 = no limit")
    p.add_argument("--limit-concurrency", type=int, default=1000,
                   help="most open HTTP connections; more get 503 and are closed; 0 = no limit")
    p.add_argument("--h11-max-incomplete-event-size", type=parse_size, default=16 * 2 ** 10,
                   help="h11's bound on a request line plus headers not yet complete in its buffer, in bytes "
                        "(uvicorn's option, as vLLM's): a client still sending them past it gets a 400 and is "
                        "disconnected; headers that arrive complete in one read are not measured against it")
    p.add_argument("--allowed-origins", default='["*"]',
                   help="CORS: origins allowed to call the API from a browser (JSON list or comma-separated)")
    p.add_argument("--allowed-methods", default='["*"]', help="CORS: allowed HTTP methods")
    p.add_argument("--allowed-headers", default='["*"]', help="CORS: allowed request headers")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="log level of pagedllm and uvicorn")
    p.add_argument("--disable-access-log", action="store_true", help="do not log one line per HTTP request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", formatter_class=_HelpFormatter,
        description="pagedllm: LLM inference and serving with PagedAttention and continuous batching.")
    from pagedllm import __version__

    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_parser(subparsers)
    add_run_batch_parser(subparsers)
    try:
        from pagedllm.benchmarks import cli as bench_cli
    except ImportError as e:
        if e.name is None or not e.name.startswith("pagedllm.benchmarks"):
            print(f"pagedllm: warning: benchmarks unavailable ({e})", file=sys.stderr)
        bench_cli = None
    if bench_cli is not None and hasattr(bench_cli, "register_subparser"):
        bench_cli.register_subparser(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    rc = args.func(args)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
