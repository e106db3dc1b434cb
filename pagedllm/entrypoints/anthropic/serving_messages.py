"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` over the Chat Completions serving: the request
is translated (``protocol.py``), served by ``OpenAIServingChat``, and its answer translated back.

Whole: a ``message`` with ``content`` blocks (``thinking`` with --reasoning-parser, ``text``,
``tool_use``), ``stop_reason`` end_turn / max_tokens / stop_sequence / tool_use and ``usage``.

Streamed: Anthropic's server-sent events, each ``event: TYPE`` + ``data: JSON``: ``message_start``,
``ping``, then per block ``content_block_start``, ``content_block_delta`` (``text_delta``,
``thinking_delta`` or ``input_json_delta`` with the tool input's JSON as it grows) and
``content_block_stop``, then ``message_delta`` (stop_reason, output tokens) and ``message_stop``; a
failure after the start is an ``error`` event.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, anthropic_error_body
from pagedllm.entrypoints.openai.protocol import RequestError, random_id
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import SSE_HEADERS

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def message_id() -> str:
    return "msg_" + random_id("x")[2:]


def tool_use_id(call_id: Optional[str]) -> str:
    """Anthropic's ``toolu_`` id for a call's id."""
    rest = (call_id or random_id("x")).rsplit("-", 1)[-1]
    return "toolu_" + rest


def stop_reason(finish_reason: Optional[str], matched: Any, stop_sequences: Optional[list[str]]
                ) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) of a choice's finish_reason and vLLM's ``stop_reason`` (the stop
    string matched, if any)."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish_reason or "", finish_reason), None


def tool_input(arguments: str) -> dict:
    """A call's arguments as the tool_use block's ``input``: the JSON object, or {} when the arguments
    are not one (a call cut by max_tokens; streamed, its partial JSON went out as it was)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        chat_req = req.to_chat_request(stream=False)
        self.chat.check_model(chat_req.model)
        ids = await self.chat.render_ids_async(chat_req)
        return {"input_tokens": len(ids)}

    async def create_message(self, req: MessagesRequest, raw_request: Request):
        chat_req = req.to_chat_request()
        resp = await self.chat.create_chat_completion(chat_req, raw_request)
        if req.stream:
            return StreamingResponse(self._stream(req, resp.body_iterator), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        out = json.loads(resp.body)
        return JSONResponse(self._message(req, out))

    def _message(self, req: MessagesRequest, out: dict) -> dict:
        choice = out["choices"][0]
        msg = choice["message"]
        content: list[dict] = []
        if msg.get("reasoning"):
            content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": tool_input(call["function"]["arguments"])})
        reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), req.stop_sequences)
        return {"id": message_id(), "type": "message", "role": "assistant", "model": out["model"],
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(out["usage"])}

    @staticmethod
    def _usage(usage: dict) -> dict:
        out = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage.get("completion_tokens") or 0}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            out["cache_read_input_tokens"] = cached
            out["cache_creation_input_tokens"] = 0
        return out

    async def _stream(self, req: MessagesRequest, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The Chat Completions chunks of one choice, as Anthropic's events."""
        started = False
        block: Optional[tuple[str, int]] = None   # the open block: (kind, tool-call index or -1)
        index = -1                                # the open block's index
        finish, matched, output_tokens = None, None, 0
        try:
            async for raw in chunks:
                for line in raw.splitlines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        status = 400 if err.get("type") == "invalid_request_error" else 500
                        yield event("error", anthropic_error_body(status, err.get("message", "error")))
                        return
                    usage = chunk.get("usage") or {}
                    if not started:
                        started = True
                        yield event("message_start", {"type": "message_start", "message": {
                            "id": message_id(), "type": "message", "role": "assistant", "model": chunk["model"],
                            "content": [], "stop_reason": None, "stop_sequence": None,
                            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}})
                        yield event("ping", {"type": "ping"})
                    if usage:
                        output_tokens = usage.get("completion_tokens", output_tokens)
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        pieces: list[tuple[tuple[str, int], dict, Optional[dict]]] = []
                        if delta.get("reasoning"):
                            pieces.append((("thinking", -1), {"type": "thinking", "thinking": "", "signature": ""},
                                           {"type": "thinking_delta", "thinking": delta["reasoning"]}))
                        if delta.get("content"):
                            pieces.append((("text", -1), {"type": "text", "text": ""},
                                           {"type": "text_delta", "text": delta["content"]}))
                        for call in delta.get("tool_calls") or []:
                            fn = call.get("function") or {}
                            start = {"type": "tool_use", "id": tool_use_id(call.get("id")), "name": fn.get("name"),
                                     "input": {}} if call.get("id") else None
                            args = fn.get("arguments")
                            pieces.append((("tool_use", call["index"]), start,
                                           {"type": "input_json_delta", "partial_json": args} if args else None))
                        for key, start, piece in pieces:
                            if block != key and key[0] == "tool_use" and start is None:
                                continue  # (arguments of a call whose block is closed: none are sent so)
                            if block != key:
                                if block is not None:
                                    yield event("content_block_stop", {"type": "content_block_stop", "index": index})
                                index += 1
                                block = key
                                yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                                    "content_block": start})
                            if piece is not None:
                                yield event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                                    "delta": piece})
                        if choice.get("finish_reason") is not None:
                            finish, matched = choice["finish_reason"], choice.get("stop_reason")
            if block is not None:
                yield event("content_block_stop", {"type": "content_block_stop", "index": index})
            reason, sequence = stop_reason(finish, matched, req.stop_sequences)
            yield event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": output_tokens}})
            yield event("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            message = e.message if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
            yield event("error", anthropic_error_body(getattr(e, "status", 500), message))
