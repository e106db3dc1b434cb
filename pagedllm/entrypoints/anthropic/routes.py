"""The Messages API routes. Every error they answer has Anthropic's shape (``{"type": "error",
"error": {"type", "message"}}``, ``anthropic_error_body``), including a malformed body; the API key
is checked by the server's gate, which takes Anthropic's ``x-api-key`` header as well as
``Authorization: Bearer`` and answers paths under ``/v1/messages`` in this shape too."""
from __future__ import annotations

import json
import logging

import pydantic
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, anthropic_error_body
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

logger = logging.getLogger("pagedllm")
PATH = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


def _validation_message(e: pydantic.ValidationError) -> str:
    err = e.errors()[0]
    raised = (err.get("ctx") or {}).get("error")
    if isinstance(raised, RequestError):
        return raised.message
    loc = ".".join(str(x) for x in err.get("loc", ()))
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return (f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))) + more


async def _parse(raw_request: Request, model: type[pydantic.BaseModel]):
    try:
        body = json.loads(await raw_request.body())
    except ValueError as e:
        raise RequestError(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        raise RequestError(_validation_message(e)) from None


def add_anthropic_routes(app: FastAPI, chat: OpenAIServingChat, before=lambda: None) -> AnthropicServingMessages:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` on ``app``; ``before()`` runs first
    (it may raise RequestError: the server's check that the model generates)."""
    serving = AnthropicServingMessages(chat)

    async def answer(work):
        try:
            before()
            return await work()
        except RequestError as e:
            return anthropic_error(e.status, e.message)
        except EngineDeadError as e:
            return anthropic_error(503, f"the engine is not running: {e}")

    @app.post(PATH)
    async def create_message(raw_request: Request):
        async def work():
            return await serving.create_message(await _parse(raw_request, MessagesRequest), raw_request)
        return await answer(work)

    @app.post(PATH + "/count_tokens")
    async def count_tokens(raw_request: Request):
        async def work():
            return JSONResponse(await serving.count_tokens(await _parse(raw_request, CountTokensRequest)))
        return await answer(work)

    return serving
