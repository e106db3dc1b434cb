"""Anthropic's Messages API (``POST /v1/messages``, https://docs.anthropic.com/en/api/messages), request
side and its translation to a Chat Completions request, as vLLM (``vllm/entrypoints/anthropic``) and
llama.cpp's server do: the conversation goes through the same chat template, sampling, tool-call
parsers and forced tool choice as ``/v1/chat/completions``.

Mapping:
- ``system`` (a string or text blocks) -> a first system message;
- a user turn's text blocks -> its content; its ``tool_result`` blocks -> ``tool`` messages (before
  the text, in order), a result's text blocks joined;
- an assistant turn's text blocks -> its content; its ``tool_use`` blocks -> ``tool_calls`` (the input
  as JSON text); ``thinking`` blocks are dropped (the template does not take them back);
- ``tools`` (name, description, input_schema) -> functions; ``tool_choice`` auto / any / tool / none
  -> "auto" / "required" / the named function / "none"; ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``;
- ``max_tokens`` (required), ``stop_sequences`` -> ``stop``, ``temperature``, ``top_p``, ``top_k``.
Images and documents are refused (text-only models).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestError

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """``{"type": "error", "error": {"type": ..., "message": ...}}`` for an HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class ContentBlock(AnthropicModel):
    """One content block of a message: text, tool_use, tool_result, thinking (or an image/document,
    refused)."""
    type: str
    text: Optional[str] = None
    id: Optional[str] = None                 # tool_use
    name: Optional[str] = None               # tool_use
    input: Optional[dict[str, Any]] = None   # tool_use
    tool_use_id: Optional[str] = None        # tool_result
    content: Optional[Union[str, list[dict[str, Any]]]] = None  # tool_result
    is_error: Optional[bool] = None          # tool_result


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class AnthropicTool(AnthropicModel):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class MessagesRequest(AnthropicModel):
    """``POST /v1/messages``'s body (``max_tokens`` required, as Anthropic's API has it)."""
    model: Optional[str] = None
    messages: list[AnthropicMessage]
    max_tokens: int = Field(ge=1)
    system: Optional[Union[str, list[ContentBlock]]] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    metadata: Optional[dict[str, Any]] = None
    seed: Optional[int] = None  # (not Anthropic's; vLLM's extension, useful for tests)

    def to_chat_request(self, stream: Optional[bool] = None) -> ChatCompletionRequest:
        """The equivalent Chat Completions request. RequestError for content this server cannot take."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(),
                                "max_tokens": self.max_tokens, "stream": self.stream if stream is None else stream}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("seed", "seed"), ("stop_sequences", "stop")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema}} for t in self.tools]
        if self.tool_choice is not None:
            tc = self.tool_choice
            if tc.type == "tool":
                if not tc.name:
                    raise RequestError("tool_choice of type tool needs a name", "tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
            if tc.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if body["stream"]:  # usage on every chunk: message_start reports the input tokens
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return ChatCompletionRequest.model_validate(body)

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else _text_of(self.system, "system")
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            where = f"messages.{i}.content"
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls = [], []
            for b in m.content:
                if b.type == "text":
                    texts.append(b.text or "")
                elif b.type == "tool_use" and m.role == "assistant":
                    if not b.id or not b.name:
                        raise RequestError("a tool_use block needs an id and a name", where)
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": json.dumps(b.input or {},
                                                                                      ensure_ascii=False)}})
                elif b.type == "tool_result" and m.role == "user":
                    if not b.tool_use_id:
                        raise RequestError("a tool_result block needs a tool_use_id", where)
                    result = b.content if isinstance(b.content, str) or b.content is None else \
                        _text_of([ContentBlock.model_validate(x) for x in b.content], where)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result or ""})
                elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                    continue
                else:
                    raise RequestError(f"a {m.role} message cannot hold a content block of type {b.type!r} here "
                                       f"(this server takes text, tool_use and tool_result blocks)", where)
            if texts or calls or not any(b.type == "tool_result" for b in m.content):
                msg: dict[str, Any] = {"role": m.role, "content": "".join(texts) if texts or not calls else None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        return out


def _text_of(blocks: list[ContentBlock], where: str) -> str:
    for b in blocks:
        if b.type != "text":
            raise RequestError(f"only text blocks are accepted here, got {b.type!r}", where)
    return "".join(b.text or "" for b in blocks)


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""
    max_tokens: int = 1
