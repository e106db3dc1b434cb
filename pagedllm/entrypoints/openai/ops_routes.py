"""What deployments built for vLLM probe besides the OpenAI API, in vLLM's shapes: ``/load``'s
in-flight request count (``ServerLoad``, with ``--enable-server-load-tracking``), ``/tokenizer_info``
(``tokenizer_info``, with ``--enable-tokenizer-info-endpoint``) and the body-based routing of
SageMaker's ``/invocations`` (``invocation_route``). The routes themselves are in ``api_server``."""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import RequestError

# The routes that run the model (vLLM counts its equivalents): a request to one of them is in
# flight from its arrival until its response (a whole stream included) has been sent.
LOAD_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/invocations",
              "/v1/messages")


class ServerLoad:
    """Pure-ASGI middleware counting the requests in flight on ``LOAD_PATHS`` (``count``, read by
    ``GET /load``). ``enabled`` False: nothing is counted and ``count`` stays 0, as vLLM reports
    without its flag."""

    def __init__(self, app, state: "LoadCounter") -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.state.enabled or not scope["path"].startswith(LOAD_PATHS):
            await self.app(scope, receive, send)
            return
        self.state.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.count -= 1


class LoadCounter:
    """``count``: inference requests in flight (``ServerLoad`` keeps it; one event loop, no lock)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.count = 0


def _json_value(value: Any) -> Any:
    """``value`` as JSON can carry it: an AddedToken becomes its text, containers are converted
    item by item, anything else JSON cannot encode becomes its ``str``."""
    if hasattr(value, "content") and not isinstance(value, (dict, str)):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def tokenizer_info(tokenizer, chat_template: Optional[str]) -> dict[str, Any]:
    """``GET /tokenizer_info`` as vLLM answers it: the tokenizer's configuration (its ``init_kwargs``,
    as tokenizer_config.json holds them, without the vocabulary and merges file paths),
    ``tokenizer_class`` (the loaded class's name) and ``chat_template`` when the server was started
    with ``--chat-template``."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for path_key in ("vocab_file", "merges_file", "tokenizer_file"):
        config.pop(path_key, None)
    config = _json_value(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def invocation_route(body: Any, pooling: bool) -> str:
    """Which API a SageMaker ``POST /invocations`` body is for: ``"chat"`` (it has ``messages``),
    ``"completions"`` (``prompt``) or ``"embeddings"`` (``input``; on an embedding server, --runner
    pooling, ``messages`` too: vLLM's chat form of /v1/embeddings). vLLM tries its request types in
    that order; routing on the key instead gives a malformed body the 400 of the API it was meant
    for. RequestError when the body is no JSON object or has none of the keys."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    if "messages" in body:
        return "embeddings" if pooling else "chat"
    if "prompt" in body:
        return "completions"
    if "input" in body:
        return "embeddings"
    raise RequestError("/invocations routes by the body: give messages (chat completions), prompt (completions) "
                       "or input (embeddings)")
