"""The OpenAI-compatible HTTP server: FastAPI app factory (``build_app``) and ``run_server``.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (+ GET/DELETE/cancel by
id, input_items), /v1/embeddings, /health, /version, /metrics, /tokenize, /detokenize, /dashboard
(and its data under /dashboard/api), and vLLM's ops routes: /ping and /invocations (SageMaker), /load,
/tokenizer_info (with --enable-tokenizer-info-endpoint). With an API key, every /v1/*, /invocations
and /dashboard/api/* route needs ``Authorization: Bearer KEY``.
Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Optional

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from pagedllm import __version__, envs
from pagedllm.engine.arg_utils import EngineArgs, ServerArgs, cli_flag
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError
from pagedllm.engine.core_client import CoreClient
from pagedllm.entrypoints.anthropic.protocol import anthropic_error_body
from pagedllm.entrypoints.anthropic.routes import add_anthropic_routes, is_anthropic_path
from pagedllm.entrypoints.dashboard.routes import add_dashboard
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, EmbeddingRequest, ModelCard,
    ModelList, RequestError, TokenizeRequest, TokenizeResponse)
from pagedllm.entrypoints.openai.http_server import GracefulServer, ensure_file_limit, guarded_http_protocol
from pagedllm.entrypoints.openai.ops_routes import LoadCounter, ServerLoad, invocation_route, tokenizer_info
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_engine import (
    BIG_PROMPT_CHARS, BIG_TOKEN_COUNT, ClientDisconnected, error_body, tokenize_error)
from pagedllm.entrypoints.openai.template_probe import probe_template
from pagedllm.logger import init_logger
from pagedllm.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.worker.multinode import run_headless

logger = logging.getLogger("pagedllm")

DEFAULT_MAX_BODY_BYTES = ServerArgs.max_request_bytes  # 4 MiB
# routes that need the API key (the dashboard page itself holds no data; /invocations runs the model)
_KEYED_PATHS = ("/v1", "/dashboard/api", "/invocations")
_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                 503: "service_unavailable"}


class SafeJSONResponse(JSONResponse):
    """JSON that never fails to encode: a lone surrogate from the client becomes U+FFFD."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", errors="replace")


def _error(status: int, message: str, param: Optional[str] = None, code=None, type_: Optional[str] = None,
           headers: Optional[dict] = None, path: str = "") -> JSONResponse:
    """The error response in OpenAI's shape, or Anthropic's for a Messages API ``path``."""
    if is_anthropic_path(path):
        return SafeJSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return SafeJSONResponse(error_body(message, type_ or _STATUS_TYPES.get(status, "server_error"), param, code),
                        status_code=status, headers=headers)


class GuardMiddleware:
    """Pure-ASGI gate in front of the app: API key on /v1/*, and a request-body size limit
    (Content-Length checked first, then the bytes actually received; the body is buffered and
    replayed so the app still sees the client's later ``http.disconnect``)."""

    def __init__(self, app, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith(_KEYED_PATHS):
            # The scheme is case-insensitive (RFC 9110 11.1); the key is compared in constant time.
            # Anthropic's clients send the key as x-api-key.
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and secrets.compare_digest(token, self.api_key)) \
                    and not secrets.compare_digest(headers.get(b"x-api-key", b""), self.api_key):
                resp = _error(401, "Invalid or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: "
                                   "<key>'.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                              path=scope["path"])
                await resp(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                await _error(400, "invalid Content-Length header")(scope, receive, send)
                return
            if too_big:
                await self._too_large(scope, receive, send)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False
        full = b"".join(chunks)

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": full, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        resp = _error(413, f"Request body is larger than the limit of {self.max_body_bytes} bytes "
                           f"(--max-request-bytes; a large image: raise it, or send a file:// or http(s) URL).",
                      code="request_too_large", path=scope["path"])
        resp.headers["Connection"] = "close"
        await resp(scope, receive, send)


# Union members add their type to an error's location (e.g. prompt.list[int]); keep the field path.
_UNION_TAG = re.compile(r"(str|int|float|bool|none|"
                        r"(list|dict|tuple|set|union|tagged-union|nullable|function-\w+)\[.*\])")


def _validation_message(exc: RequestValidationError,
                        content_type: str = "application/json") -> tuple[str, Optional[str]]:
    """The first error as (message, param); ``content_type``: the request's Content-Type header."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    if err.get("type") == "json_invalid":
        return f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    # FastAPI's location starts with where the value came from (body, query, path): the param is the rest.
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    loc = [str(x) for x in loc if not _UNION_TAG.fullmatch(str(x))]
    raised = (err.get("ctx") or {}).get("error")
    if isinstance(raised, RequestError):  # a validator's own clear message, without pydantic's prefix
        if raised.param and loc and raised.param.split(".")[0] == loc[-1]:  # relative to its field
            return raised.message, ".".join(loc[:-1] + [raised.param])
        return raised.message, ".".join(loc) or raised.param
    if not loc and err.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type"):
        if "json" not in content_type.lower():  # e.g. curl -d without -H, which sends a form
            return (f"The request body must be a JSON object sent with Content-Type: application/json "
                    f"(got {content_type[:100] or 'none'!r})."), None
        if err.get("type") == "missing":
            return "The request body is empty: send a JSON object.", None
        return "The request body must be a JSON object.", None
    param = ".".join(loc) or None
    msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return msg, param


async def _json_body(request: Request) -> dict:
    """The request's JSON object; 400 when it is not one."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise RequestError("the request body is not valid JSON", None, 400) from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, 400)
    return body


def build_app(llm: AsyncLLM, served_model_name: Optional[str] = None, api_key: Optional[str] = None,
              chat_template: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_engine: bool = True, response_store: Optional[ResponseStore] = None,
              dashboard: bool = True, cors: Optional[dict] = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, enable_prompt_tokens_details: bool = False,
              enable_server_load_tracking: bool = False, enable_tokenizer_info_endpoint: bool = False,
              lora_modules: Optional[list[str]] = None, allow_runtime_lora_updating: bool = False,
              json_additional_properties: str = "forbid") -> FastAPI:
    """The FastAPI app over a (started) AsyncLLM. With ``shutdown_engine`` the app's lifespan
    shutdown also stops the engine. ``response_store`` keeps Responses API responses (default: 1,024
    responses for an hour); ``dashboard`` mounts the block-pool dashboard at /dashboard. ``cors``:
    keyword arguments of starlette's CORSMiddleware (allow_origins, allow_methods, allow_headers,
    allow_credentials); None = no CORS headers. The ``enable_*`` switches are vLLM's flags of those
    names (ServerArgs). ``lora_modules`` / ``allow_runtime_lora_updating``: the LoRA adapters served
    (serving_models.py; ValueError for one that cannot be served)."""
    served = served_model_name or llm.model_config.served_model_name
    models = OpenAIServingModels(llm, served, lora_modules,
                                 allow_runtime_lora_updating or envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING)
    metrics = ServerMetrics(lambda: llm.snapshot, served, llm.engine.config.scheduler_config.stream_interval)
    llm.on_outputs = metrics.record_outputs
    llm.on_abort = metrics.record_abort
    completions = OpenAIServingCompletion(llm, served, chat_template)
    chat = OpenAIServingChat(llm, served, chat_template)
    chat.enable_auto_tools = enable_auto_tool_choice
    chat.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    chat.template_tools = probe_template(chat.tokenizer, chat_template)
    if chat.template_tools.warning(served):
        logger.warning(chat.template_tools.warning(served))
    if reasoning_parser is None and getattr(llm.model_config.hf_config, "model_type", None) == "gpt_oss":
        reasoning_parser = "openai_gptoss"  # its output is always in harmony's channels (vLLM reads them too)
        logger.info("gpt-oss: reading its harmony channels (reasoning parser openai_gptoss; tool calls with "
                    "--enable-auto-tool-choice --tool-call-parser openai)")
    chat.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
    responses = OpenAIServingResponses(chat, response_store if response_store is not None else ResponseStore())
    embeddings = OpenAIServingEmbedding(llm, served, chat)
    for serving in (completions, chat):
        serving.enable_prompt_tokens_details = enable_prompt_tokens_details
        serving.allow_additional_properties = json_additional_properties == "allow"
    for serving in (completions, chat, embeddings):
        serving.models = models
    load = LoadCounter(enable_server_load_tracking)

    def generating() -> None:
        """The text endpoints need the generating runner."""
        if llm.engine.pooling:
            raise RequestError("this server runs an embedding model (--runner pooling): use /v1/embeddings",
                               "model", 400, "model_not_supported")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        history = getattr(app.state, "dashboard_history", None)
        if history is not None:
            history.stop()
        if shutdown_engine:
            llm.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llm = llm
    app.state.metrics = metrics

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.type, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc, request.headers.get("content-type", ""))
        return _error(400, msg, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        return _error(503, f"The engine is not running: {exc}", code="engine_dead")

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error while serving a request")
        return _error(500, f"Internal server error: {type(exc).__name__}", type_="server_error",
                      path=request.url.path)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if llm.check_health():
            return Response(status_code=200)
        return _error(503, f"The engine is not running: {llm.dead_reason}", code="engine_dead")

    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check
    async def ping():
        return await health()

    @app.get("/load")
    async def server_load():
        """vLLM's load report: inference requests in flight (always 0 without --enable-server-load-tracking)."""
        return {"server_load": load.count}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    card = ModelCard(id=served, root=llm.model_config.model, max_model_len=llm.model_config.max_model_len)

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(ModelList(data=models.cards(card.max_model_len)).model_dump())

    @app.get("/v1/models/{model_id:path}")  # the openai client's models.retrieve(); ids may contain "/"
    async def retrieve_model(model_id: str):
        completions.check_model(model_id)
        return JSONResponse(next(c for c in models.cards(card.max_model_len) if c.id == model_id).model_dump())

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request):
        return Response(await models.load(await _json_body(raw_request)), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request):
        return Response(await models.unload(await _json_body(raw_request)), media_type="text/plain")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        generating()
        return await completions.create_completion(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        generating()
        return await chat.create_chat_completion(body, raw_request)

    add_anthropic_routes(app, chat, before=generating)  # /v1/messages (Anthropic's Messages API)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw_request: Request):
        generating()
        return await responses.create(body, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw_request: Request):
        return JSONResponse(await embeddings.create_embedding(body, raw_request))

    @app.post("/invocations")
    async def invocations(raw_request: Request):
        """SageMaker's one inference route: the body is a chat, completion or embedding request
        (``ops_routes.invocation_route``), answered as its own route answers it."""
        try:
            body = json.loads(await raw_request.body())
        except ValueError as e:
            raise RequestError(f"Invalid JSON body: {e}") from None
        route = invocation_route(body, llm.engine.pooling)
        model = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "embeddings": EmbeddingRequest}[route]
        try:
            req = model.model_validate(body)
        except pydantic.ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if route == "chat":
            return await create_chat_completion(req, raw_request)
        if route == "completions":
            return await create_completion(req, raw_request)
        return await create_embedding(req, raw_request)

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            return SafeJSONResponse(tokenizer_info(chat.tokenizer, chat_template))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: Optional[bool] = None, starting_after: Optional[int] = None):
        return responses.retrieve(response_id, stream, starting_after)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: Optional[str] = None, limit: int = 20, order: str = "desc"):
        return responses.input_items(response_id, after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await responses.cancel(response_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        chat.check_model(body.model)
        if body.messages is not None:
            ids = (await chat.render_async(body))[0]  # (images expanded to their tokens)
        else:
            encode = functools.partial(chat.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
            try:  # a long text is tokenized off the event loop, as for completions
                ids = await asyncio.to_thread(encode) if len(body.prompt) > BIG_PROMPT_CHARS else encode()
            except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the client's text
                raise tokenize_error("prompt", e) from None
        strs = None
        if body.return_token_strs:
            names = functools.partial(chat.tokenizer.convert_ids_to_tokens, ids)
            strs = await asyncio.to_thread(names) if len(ids) > BIG_TOKEN_COUNT else names()
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=chat.max_model_len,
                                token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        chat.check_model(body.model)
        vocab = llm.engine.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise RequestError(f"token ids must be integers in [0, {vocab})", "tokens")
        decode = functools.partial(chat.tokenizer.decode, body.tokens)
        text = await asyncio.to_thread(decode) if len(body.tokens) > BIG_TOKEN_COUNT else decode()
        return DetokenizeResponse(prompt=text).model_dump()

    if dashboard:
        add_dashboard(app, llm, metrics)
    app.add_middleware(ServerLoad, state=load)  # inside the guard: a refused request is not load
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    if cors is not None:
        # Added last, so outermost: a preflight (OPTIONS) is answered before the API-key check, and
        # errors from the guard (401, 413) still carry the CORS headers the browser needs to read them.
        app.add_middleware(CORSMiddleware, **cors)
    return app


def parse_list(value: str) -> list[str]:
    """A flag's list: JSON (``'["https://a.com"]'``, as vLLM takes it) or comma-separated."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [x.strip() for x in value.split(",") if x.strip()]


def cors_options(args: ServerArgs) -> dict:
    """CORSMiddleware keyword arguments from ``--allowed-origins/--allowed-methods/--allowed-headers/
    --allow-credentials`` (vLLM's flags and defaults). Raises ValueError for a list that is not one."""
    return dict(allow_origins=parse_list(args.allowed_origins), allow_methods=parse_list(args.allowed_methods),
                allow_headers=parse_list(args.allowed_headers), allow_credentials=args.allow_credentials)


# ---- running the server ----------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (bound before the model loads, so a busy port fails fast)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def flag_names(message: str) -> str:
    """An engine error as ``pagedllm serve`` users know it: EngineArgs field names (max_model_len)
    become the CLI flags that set them (--max-model-len)."""
    for name in EngineArgs.field_names():
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}\b", cli_flag(name), message)
    return message


class _Interrupted(BaseException):
    pass


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``'s template: a file's text, or the value itself when it is inline Jinja (None: none).
    Raises ValueError for anything else."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value  # an inline template
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def check_tool_flags(args: ServerArgs) -> None:
    """ValueError for --enable-auto-tool-choice without a parser, or a parser name that is not one."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)  # ValueError naming the known parsers
    if args.reasoning_parser:
        get_reasoning_parser(args.reasoning_parser)


def _exit_when_engine_dies(llm: AsyncLLM, server, died: threading.Event, poll_s: float = 1.0,
                           grace_s: float = 2.0) -> None:
    """Watch the engine; once it is dead, let /health answer 503 for ``grace_s`` seconds (so
    load balancers see it), then stop the server, which then exits non-zero."""
    while not server.should_exit:
        if not llm.check_health():
            died.set()
            time.sleep(grace_s)
            server.should_exit = True
            return
        time.sleep(poll_s)


def _run_headless(engine_args: EngineArgs) -> int:
    """``pagedllm serve --headless``: this node's worker ranks of a multi-node launch, no server."""
    try:
        return run_headless(engine_args.create_engine_config())
    except (ValueError, OSError) as e:
        print(f"pagedllm serve: error: {e}", file=sys.stderr)
        return 1


def start_engine(engine_args: EngineArgs, data_parallel_size: int, log_level: str,
                 core_process: bool = True) -> AsyncLLM:
    """The started engine: the engine core in its own process (``CoreClient``; ``data_parallel_size``
    > 1: that many), or with ``core_process`` False and one replica, an AsyncLLM whose engine runs in
    a thread of this process."""
    if data_parallel_size > 1 or core_process:
        return CoreClient(engine_args, data_parallel_size, log_level=log_level).start()
    logger.info("engine core: a thread of the API server process (--no-engine-core-process or "
                "PAGEDLLM_ENABLE_MULTIPROCESSING=0)")
    return AsyncLLM.from_engine_args(engine_args).start()


def run_server(args: argparse.Namespace) -> int:
    """``pagedllm serve``: load the engine, serve until SIGINT/SIGTERM, return the exit code. ``args``: parsed by
    a parser with the EngineArgs and ServerArgs flags (``pagedllm.entrypoints.cli.add_server_args``)."""
    import uvicorn  # lazily: only a running server needs it

    engine_args, opts = EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args)
    log_level = opts.log_level.upper()
    init_logger(log_level)
    if opts.headless:
        return _run_headless(engine_args)
    if engine_args.nnodes > 1 and engine_args.node_rank != 0:
        print("pagedllm serve: error: only node 0 serves the API; start the other nodes with --headless",
              file=sys.stderr)
        return 1
    api_key = opts.api_key or envs.PAGEDLLM_API_KEY
    host = opts.host
    try:
        store = ResponseStore(opts.max_stored_responses, opts.stored_response_ttl, opts.max_stored_response_bytes)
        sock = _bind(host, opts.port)
    except ValueError as e:
        print(f"pagedllm serve: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"pagedllm serve: error: cannot listen on {host}:{opts.port}: {e.strerror or e}", file=sys.stderr)
        return 1

    def interrupted(signum, frame):
        raise _Interrupted()

    old_handlers = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    llm: Optional[AsyncLLM] = None
    try:
        try:
            chat_template = read_chat_template(opts.chat_template)
            check_tool_flags(opts)
            llm = start_engine(engine_args, opts.data_parallel_size, log_level,
                               opts.engine_core_process and envs.PAGEDLLM_ENABLE_MULTIPROCESSING)
        except _Interrupted:
            return 0
        except (ValueError, OSError) as e:
            print(f"pagedllm serve: error: {flag_names(str(e))}", file=sys.stderr)
            return 1
        except RuntimeError as e:  # a worker or replica failed to start
            print(f"pagedllm serve: error: {e}", file=sys.stderr)
            return 1

        try:
            cors = cors_options(opts)
        except ValueError as e:
            print(f"pagedllm serve: error: {e}", file=sys.stderr)
            return 1
        # The dashboard samples one engine's block pool (data-parallel replicas each keep their own).
        dashboard = opts.dashboard and opts.data_parallel_size == 1
        try:
            app = build_app(llm, api_key=api_key, chat_template=chat_template, max_body_bytes=opts.max_request_bytes,
                            response_store=store, dashboard=dashboard, cors=cors,
                            enable_auto_tool_choice=opts.enable_auto_tool_choice,
                            tool_call_parser=opts.tool_call_parser, reasoning_parser=opts.reasoning_parser,
                            enable_prompt_tokens_details=opts.enable_prompt_tokens_details,
                            enable_server_load_tracking=opts.enable_server_load_tracking,
                            enable_tokenizer_info_endpoint=opts.enable_tokenizer_info_endpoint,
                            lora_modules=opts.lora_modules,
                            allow_runtime_lora_updating=opts.allow_runtime_lora_updating,
                            json_additional_properties=opts.json_additional_properties)
        except ValueError as e:  # a --lora-modules adapter that cannot be served
            print(f"pagedllm serve: error: {e}", file=sys.stderr)
            return 1
        ensure_file_limit(opts.limit_concurrency)
        http = guarded_http_protocol(opts.limit_concurrency or None, opts.timeout_request_read or None)
        config = uvicorn.Config(app, log_level=opts.log_level.lower(), access_log=not opts.disable_access_log,
                                timeout_keep_alive=opts.timeout_keep_alive, http=http,
                                h11_max_incomplete_event_size=opts.h11_max_incomplete_event_size)
        server = GracefulServer(config, opts.shutdown_timeout, llm.abort_all)
        app.state.uvicorn_server = server  # long-lived streams (the dashboard) end when it stops
        shown_host = host if ":" not in host else f"[{host}]"
        url = f"http://{shown_host}:{sock.getsockname()[1]}"
        logger.info("serving %s at %s (OpenAI API: %s/v1)%s", llm.model_config.served_model_name, url, url,
                    " with API key" if api_key else "")
        # uvicorn handles SIGINT/SIGTERM (stop accepting, drain, lifespan shutdown) and then re-raises
        # the signal to the handler that was installed before it: make that one a no-op so we exit 0.
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda signum, frame: None)
        engine_died = threading.Event()
        threading.Thread(target=_exit_when_engine_dies, args=(llm, server, engine_died), daemon=True,
                         name="pagedllm-health").start()
        server.run(sockets=[sock])
        if engine_died.is_set():
            logger.error("exiting: %s", llm.dead_reason)
            return 1
        return 0
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda signum, frame: None)
        if llm is not None:
            llm.shutdown()
        sock.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
