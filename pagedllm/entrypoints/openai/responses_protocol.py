"""Pydantic models of the OpenAI Responses API (``POST /v1/responses``): the request, the
``response`` object, its output items, and the typed stream events.

Shapes follow OpenAI's API reference for Responses (``openai.types.responses`` in the official SDK):
an output is a list of items (``message`` with ``output_text`` parts, or ``function_call``);
streaming sends typed server-sent events, each with a ``sequence_number``.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import Field, StrictInt, ValidationError, field_validator

import uuid

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, RequestBody, RequestError, StructuredOutputsRequest

_INT32_MAX = 2 ** 31 - 1


def _oid(prefix: str) -> str:
    """An id in OpenAI's Responses style (``resp_…``, ``msg_…``, ``fc_…``, ``call_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items -------------------------------------------------------------------------------
class InputContentPart(OpenAIBaseModel):
    """A content part of an input message: ``input_text`` / ``output_text`` (text), or a part this
    text-only server refuses (``input_image``, ``input_file``, ``input_audio``)."""

    type: str
    text: Optional[str] = None
    image_url: Optional[str] = None  # input_image: a data:, file:// or http(s):// URL
    detail: Optional[str] = None     # input_image: accepted, not used


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def chat_content(self, where: str = "input") -> Any:
        """The content as a chat message holds it: the text, or, with input_image parts, a list of
        text and ``image_url`` parts in order (RequestError for other non-text parts). ``where``:
        this item's path in the request ("input.3"), which errors name as ``{where}.content.{j}``."""
        if isinstance(self.content, str) or not any(p.type == "input_image" for p in self.content):
            return self.text(where)
        out: list[dict] = []
        for j, part in enumerate(self.content):
            if part.type == "input_image":
                if not part.image_url:
                    raise RequestError("an input_image part needs an image_url (file_id is not supported)",
                                       f"{where}.content.{j}")
                out.append({"type": "image_url", "image_url": {"url": part.image_url}})
            else:
                out.append({"type": "text", "text": _part_text(part, f"{where}.content.{j}")})
        return out

    def text(self, where: str = "input") -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(_part_text(part, f"{where}.content.{j}") for j, part in enumerate(self.content))


def _part_text(part: InputContentPart, param: str) -> str:
    """A text part's text; RequestError naming ``param`` for a part of another kind."""
    if part.type not in ("input_text", "output_text", "text") or part.text is None:
        kind = part.type.removeprefix("input_")
        raise RequestError(f"This model is text-only: it cannot take {kind} input "
                           f"(input content part of type {part.type!r}).", param)
    return part.text


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text or "" for p in self.output)


class ReasoningItem(OpenAIBaseModel):
    """A reasoning item sent back as input (a previous response's output): kept in the input items,
    not rendered (chat templates drop earlier turns' reasoning)."""
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[Any] = Field(default_factory=list)
    content: Optional[list[Any]] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
_INPUT_ITEM_MODELS = {"message": InputMessage, "function_call": FunctionCallItem,
                      "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_INPUT_ITEM_TYPES = tuple(_INPUT_ITEM_MODELS)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


# ---- tools and text format ---------------------------------------------------------------------
class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    def to_chat_tool(self) -> dict:
        """The same tool in the Chat Completions shape (``{"type": "function", "function": {...}}``)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object",
                                                                                  "properties": {}}}
        if self.description is not None:
            fn["description"] = self.description
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class TextFormat(OpenAIBaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict", "description"}``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None

    def to_response_format(self) -> Optional[dict]:
        """The Chat Completions ``response_format`` that constrains the same output, or None."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise RequestError("text.format of type json_schema needs a schema", "text.format.schema")
        js: dict[str, Any] = {"name": self.name or "response", "schema": self.schema_}
        if self.strict is not None:
            js["strict"] = self.strict
        return {"type": "json_schema", "json_schema": js}

    def dump(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


# ---- the request --------------------------------------------------------------------------------
class ResponsesRequest(RequestBody):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=_INT32_MAX)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: Optional[str] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    # Fields we refuse rather than ignore (see ``check_unsupported``).
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    max_tool_calls: Optional[int] = None
    prompt: Optional[dict[str, Any]] = None
    conversation: Optional[Any] = None
    service_tier: Optional[str] = None
    # vLLM-style extras accepted by /v1/completions and /v1/chat/completions too.
    structured_outputs: Optional[StructuredOutputsRequest] = None  # (with text.format "text")
    seed: Optional[int] = None
    top_k: Optional[int] = Field(None, ge=-1, le=_INT32_MAX)
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    priority: StrictInt = 0  # lower runs first under --scheduling-policy priority (a 400 otherwise)

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, value: Any) -> Any:
        # One clear sentence naming the item and its field, instead of pydantic's error for each
        # member of the item union.
        for i, item in enumerate(value if isinstance(value, list) else ()):
            if not isinstance(item, dict):
                raise RequestError(f"input item {i} must be an object (a message, function_call or "
                                   f"function_call_output item)", f"input.{i}")
            kind = item.get("type", "message")
            if not isinstance(kind, str) or kind not in _INPUT_ITEM_TYPES:
                raise RequestError(f"input item {i} has type {str(kind)[:40]!r}; this server takes "
                                   f"{', '.join(_INPUT_ITEM_TYPES)} items", f"input.{i}")
            try:
                _INPUT_ITEM_MODELS[kind].model_validate(item)
            except ValidationError as e:
                first = e.errors()[0]
                field = ".".join(str(part) for part in first["loc"])
                raise RequestError(f"input item {i} ({kind}): {field}: {first['msg']}", f"input.{i}.{field}") from None
        return value

    def check_unsupported(self) -> None:
        """Refuse (400) every documented field this server cannot honour, naming it."""
        if self.metadata is not None:
            if len(self.metadata) > 16:
                raise RequestError("metadata can hold at most 16 pairs", "metadata")
            for k, v in self.metadata.items():
                if len(k) > 64 or len(v) > 512:
                    raise RequestError("metadata keys are at most 64 characters and values at most 512",
                                       "metadata")
        if self.background and not self.store:
            raise RequestError("background responses must be stored: set store to true (or drop background)",
                               "background")
        if self.truncation == "auto":
            raise RequestError("truncation 'auto' is not supported; input longer than the context is refused",
                               "truncation")
        # reasoning.effort reaches a chat template that reads it (serving_responses); nothing else does
        other = {k: v for k, v in (self.reasoning or {}).items() if k != "effort" and v is not None}
        if other:
            raise RequestError(f"reasoning.{next(iter(other))} is not supported by this server", "reasoning")
        for name in ("prompt", "conversation", "max_tool_calls"):
            if getattr(self, name) is not None:
                raise RequestError(f"{name} is not supported by this server", name)
        other = [v for v in self.include or () if v != LOGPROBS_INCLUDE]
        if other:
            raise RequestError(f"include values are not supported: {other} (only {LOGPROBS_INCLUDE!r})", "include")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise RequestError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}", "top_logprobs")
        if self.service_tier not in (None, "auto", "default"):
            raise RequestError(f"service_tier {self.service_tier!r} is not supported", "service_tier")

    @property
    def num_logprobs(self) -> Optional[int]:
        """Alternatives a token's logprob comes with (0: the token's own only); None: no logprobs.
        Asked for by ``include: ["message.output_text.logprobs"]`` or by ``top_logprobs``."""
        if LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    def input_items(self) -> list[dict[str, Any]]:
        """The ``input`` as OpenAI's input items (what ``GET /v1/responses/{id}/input_items`` lists):
        each with an id (the client's, else a new one) and status "completed"."""
        if isinstance(self.input, str):
            return [{"type": "message", "id": _oid("msg"), "status": "completed", "role": "user",
                     "content": [{"type": "input_text", "text": self.input}]}]
        items = []
        for item in self.input:
            if isinstance(item, InputMessage):
                kind = "output_text" if item.role == "assistant" else "input_text"
                content = ([{"type": kind, "text": item.content}] if isinstance(item.content, str)
                           else [p.model_dump(exclude_none=True) for p in item.content])
                items.append({"type": "message", "id": item.id or _oid("msg"), "status": "completed",
                              "role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                items.append({"type": "function_call", "id": item.id or _oid("fc"), "status": "completed",
                              "call_id": item.call_id, "name": item.name, "arguments": item.arguments})
            elif isinstance(item, ReasoningItem):
                items.append({**item.model_dump(exclude_none=True), "id": item.id or _oid("rs")})
            else:
                items.append({"type": "function_call_output", "id": item.id or _oid("fco"), "status": "completed",
                              "call_id": item.call_id, "output": item.text()})
        return items


# ---- the response object ------------------------------------------------------------------------
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: _oid("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: _oid("fc"))
    call_id: str = Field(default_factory=lambda: _oid("call"))
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(OpenAIBaseModel):
    """The model's chain of thought (with ``--reasoning-parser``), before its message."""
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: _oid("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


class ResponseObject(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _oid("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus = "in_progress"
    completed_at: Optional[int] = None  # Unix seconds, once the status is "completed"
    background: bool = False
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    temperature: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: Optional[float] = None
    truncation: str = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
