"""``pagedllm run-batch -i requests.jsonl -o results.jsonl MODEL``: a file of OpenAI Batch API requests
run offline (vLLM's ``run-batch``), through the same handlers as ``pagedllm serve`` but with no HTTP
server: each request is one ASGI call into the app, all of them at once, so the engine batches them.

Input lines (OpenAI's batch input format): ``{"custom_id": ..., "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions" | "/v1/embeddings", "body": {...}}``. Output lines, in
input order: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; a
request the server answers with an error keeps its status code and error body, a line that is not a
request has ``response`` null and ``error`` {"code", "message"}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any, Optional

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs, ServerArgs
from pagedllm.entrypoints.openai.api_server import (build_app, check_tool_flags, flag_names, read_chat_template,
                                                    start_engine)
from pagedllm.logger import init_logger

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


async def asgi_post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``path`` of the ASGI ``app`` in this process: (status, response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    delivered = False
    done = asyncio.Event()
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client never goes away before its answer
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)


def _error_line(custom_id: Optional[str], code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


async def run_line(app: Any, line: str) -> dict:
    """One input line -> its output line."""
    try:
        req = json.loads(line)
    except ValueError as e:
        return _error_line(None, "invalid_json", f"the line is not JSON: {e}")
    if not isinstance(req, dict):
        return _error_line(None, "invalid_request", "a line must be a JSON object")
    custom_id = req.get("custom_id")
    url, body = req.get("url"), req.get("body")
    if str(req.get("method", "POST")).upper() != "POST":
        return _error_line(custom_id, "invalid_request", f"method must be POST, got {req.get('method')!r}")
    if url not in URLS:
        return _error_line(custom_id, "invalid_url", f"url must be one of {', '.join(URLS)}; got {url!r}")
    if not isinstance(body, dict):
        return _error_line(custom_id, "invalid_request", "body must be a JSON object")
    if body.get("stream"):
        return _error_line(custom_id, "invalid_request", "stream is not supported in a batch")
    status, raw = await asgi_post(app, url, json.dumps(body).encode())
    request_id = f"batch_req_{uuid.uuid4().hex}"
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {"error": {"message": raw.decode(errors="replace"), "type": "server_error"}}
    return {"id": request_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": payload}, "error": None}


async def run_lines(app: Any, lines: list[str]) -> list[dict]:
    """Every line at once (the engine batches them); results in input order, with a progress bar."""
    bar = tqdm(total=len(lines), desc="Batch requests", dynamic_ncols=True)

    async def one(line: str) -> dict:
        try:
            return await run_line(app, line)
        finally:
            bar.update(1)
    try:
        return await asyncio.gather(*(one(line) for line in lines))
    finally:
        bar.close()


def run_batch(args: argparse.Namespace) -> int:
    """``pagedllm run-batch``: returns 0, or 1 when the files or the engine cannot be set up (a
    request that fails is a result line, not a failure of the run). ``args``: parsed by ``pagedllm run-batch``'s
    parser (its -i/-o and the EngineArgs and ServerArgs flags)."""
    engine_args, opts = EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args)
    init_logger(opts.log_level.upper())
    try:
        if args.input_file == "-":
            text = sys.stdin.read()
        else:
            with open(args.input_file, encoding="utf-8-sig") as f:  # (a BOM, as Windows editors write, dropped)
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"pagedllm run-batch: error: cannot read {args.input_file}: {getattr(e, 'strerror', None) or e}",
              file=sys.stderr)
        return 1
    # Lines end at "\n" only: U+2028 and its kind may sit raw inside a JSON string (str.splitlines splits there).
    lines = [ln.rstrip("\r") for ln in text.split("\n") if ln.strip()]
    try:  # the output file is opened before any work, so a bad path fails at once
        sink = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    except OSError as e:
        print(f"pagedllm run-batch: error: cannot write {args.output_file}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        try:
            chat_template = read_chat_template(opts.chat_template)
            check_tool_flags(opts)
            llm = start_engine(engine_args, opts.data_parallel_size, opts.log_level.upper())
        except (ValueError, OSError, RuntimeError) as e:
            print(f"pagedllm run-batch: error: {flag_names(str(e))}", file=sys.stderr)
            return 1
        try:
            app = build_app(llm, chat_template=chat_template, dashboard=False, shutdown_engine=False,
                            enable_auto_tool_choice=opts.enable_auto_tool_choice,
                            tool_call_parser=opts.tool_call_parser, reasoning_parser=opts.reasoning_parser,
                            enable_prompt_tokens_details=opts.enable_prompt_tokens_details)
            results = asyncio.run(run_lines(app, lines))
        except KeyboardInterrupt:
            print("pagedllm run-batch: interrupted; no results written", file=sys.stderr)
            return 130
        finally:
            llm.shutdown()
        try:
            sink.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
            sink.flush()
        except OSError as e:
            print(f"pagedllm run-batch: error: cannot write {args.output_file}: {e.strerror or e}", file=sys.stderr)
            return 1
    finally:
        if sink is not sys.stdout:
            sink.close()
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"pagedllm run-batch: {len(results)} requests, {len(results) - failed} succeeded, {failed} failed; "
          f"results in {args.output_file}", file=sys.stderr)
    return 0
