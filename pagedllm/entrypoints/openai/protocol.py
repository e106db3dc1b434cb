"""Pydantic models of the OpenAI-compatible API (requests, responses, stream chunks, errors).

Request models turn themselves into ``SamplingParams``; any out-of-range value becomes a
``RequestError`` naming the offending field (the server answers 400 with it).
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_serializer, model_validator

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams

MAX_N = 128                 # completions per prompt
MAX_CHOICES = 1024          # prompts x n in one request
MAX_STOP = 256              # stop strings per request (each is matched against every new token's text)
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 63 - 1 - MAX_N   # torch.Generator range, room for seed + i
_INT32_MAX = 2 ** 31 - 1


class RequestError(ValueError):
    """A request the server rejects: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset((int, float, bool, type(None)))


def lone_surrogate_path(data: Any) -> Optional[str]:
    """The dotted path (``messages.0.content``, ``metadata.k``; ``""``: the body itself) of a string
    or object key (its surrogates written as escapes in the path) in a parsed JSON body that holds a
    lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape decodes to one), or None. Such a string is not
    Unicode text: the tokenizer and every JSON encoder refuse it, so the request is refused up front.
    Iterative (nesting depth is whatever the JSON parser allowed); paths are built only for the one
    found, so a million token ids cost one type check each."""
    def path_of(node: Any) -> str:
        keys = []
        while node is not None:
            node, key = node
            keys.append(_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", str(key)))
        return ".".join(reversed(keys))

    if isinstance(data, str):
        return "" if _SURROGATE.search(data) else None
    if not isinstance(data, (dict, list)):
        return None
    stack: list[tuple[Any, Any]] = [(data, None)]  # (container, its path as (parent path, key) links)
    while stack:
        value, path = stack.pop()
        if isinstance(value, list) and _SCALARS.issuperset(map(type, value)):
            continue  # token ids, numbers: one pass in C
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str) and _SURROGATE.search(k):
                return path_of((path, k))
            c = v.__class__
            if c is str:
                if _SURROGATE.search(v):
                    return path_of((path, k))
            elif c is dict or c is list:
                stack.append((v, (path, k)))
    return None


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as vLLM does (request models log each name once); NaN/inf are rejected.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null on a field whose default is not null means "not set": the OpenAI
        reference types its optional fields as nullable (``n``: "integer or null"), and clients
        that send every field send null for the unset ones."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data


class RequestBody(OpenAIBaseModel):
    """A request body (the endpoints' top-level models): refused with a 400 naming the field when
    any string in it is not valid Unicode text (see lone_surrogate_path)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            where = f"'{path}'" if path else "the body"
            raise RequestError(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate "
                               f"(a \\ud800-\\udfff escape without its pair)", param=path or None)
        return data


# ---- errors ------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[int, str, None] = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared request fields -----------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk too


# ---- structured outputs and tools (request side) ----------------------------------------------
class JsonSchemaFormat(OpenAIBaseModel):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI ``response_format``: "text", "json_object" or "json_schema" (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field (exactly one constraint)."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    # vLLM's: true refuses keys a schema does not declare; unset or false: the server's rule
    disable_additional_properties: Optional[bool] = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    """One streamed fragment of a tool call: the first carries ``id``, ``type`` and the name;
    the next ones carry pieces of ``function.arguments``."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


def structured_outputs_from_request(req: Any) -> Optional[StructuredOutputsParams]:
    """``StructuredOutputsParams`` from a request's ``structured_outputs`` / ``guided_*`` /
    ``response_format`` fields (None when none is set). RequestError when two are set or one is
    malformed. Reused by every route that takes these fields."""
    given: list[tuple[str, dict]] = []
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        given.append(("structured_outputs", {"json": so.json_, "json_object": so.json_object, "regex": so.regex,
                                             "choice": so.choice, "grammar": so.grammar,
                                             "disable_any_whitespace": so.disable_any_whitespace,
                                             "whitespace_pattern": so.whitespace_pattern,
                                             "disable_additional_properties": so.disable_additional_properties
                                             or None}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name, None) is not None:
            given.append((name, {key: getattr(req, name)}))
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError("response_format of type json_schema needs json_schema.schema", "response_format")
        else:
            # strict: true is OpenAI's promise of exactly the schema: no undeclared keys, whatever the server's rule
            given.append(("response_format", {"json": rf.json_schema.schema_,
                                               "disable_additional_properties": rf.json_schema.strict or None}))
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give only one of {', '.join(n for n, _ in given)}", given[1][0])
    name, kwargs = given[0]
    if getattr(req, "guided_whitespace_pattern", None) is not None and "json" in kwargs:
        kwargs["whitespace_pattern"] = req.guided_whitespace_pattern
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise RequestError(f"{name}: {e}", name) from None


_FIELD_RE = re.compile(r"^(\w+)\b")
_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def sampling_params_from(req: Any, kwargs: dict[str, Any], optional: tuple[str, ...]) -> SamplingParams:
    """``SamplingParams(**kwargs)`` plus each field of ``req`` named in ``optional`` that the request set
    (not None; the rest keep SamplingParams' defaults). RequestError naming the field it rejects."""
    kwargs = {**kwargs, **{name: getattr(req, name) for name in optional if getattr(req, name) is not None}}
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        m = _FIELD_RE.match(str(e))
        param = m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else None
        raise RequestError(str(e), param) from None


# ---- documented fields this server does not apply ---------------------------------------------
# Every field OpenAI or vLLM documents for /v1/completions and /v1/chat/completions is either applied
# or refused with a 400 naming it; none is dropped silently. Fields here are declared so that their
# use can be refused (or, for pure metadata, accepted: they ask nothing of the server).
_unknown_logged: set[str] = set()
_logger = logging.getLogger("pagedllm")


class _DocumentedFields(RequestBody):
    # OpenAI metadata: accepted, they change nothing about the output.
    metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None  # prefix caching is automatic
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    # vLLM sampling/engine fields
    best_of: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    prompt_logprobs: Optional[int] = None
    priority: StrictInt = 0  # lower runs first under --scheduling-policy priority (a 400 otherwise)
    request_id: Optional[str] = None
    logits_processors: Optional[Any] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    cache_salt: Optional[str] = None
    kv_transfer_params: Optional[Any] = None
    vllm_xargs: Optional[Any] = None

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        """Unknown fields stay accepted (as in vLLM) and are logged once per field name."""
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields and key not in _unknown_logged and len(_unknown_logged) < 1000:
                    _unknown_logged.add(key)
                    _logger.warning("ignoring unknown request field %r (logged once per field name)", key[:100])
        return data

    def check_documented_fields(self, n: int) -> None:
        """RequestError naming the first documented field asked for that this server cannot apply."""
        best_of = self.best_of
        refused = {
            "store": (self.store, "store=true is not supported: completions are not stored"),
            "service_tier": (self.service_tier not in (None, "auto", "default"),
                             f"service_tier {self.service_tier!r} is not supported; use 'auto' or 'default'"),
            "best_of": (best_of is not None and best_of != n,
                        f"best_of must equal n ({n}), got {best_of}: returning the best of more samples "
                        f"is not supported"),
            "use_beam_search": (self.use_beam_search, "use_beam_search is not supported"),
            "length_penalty": (self.length_penalty != 1.0,
                               "length_penalty applies to beam search, which is not supported"),
            "spaces_between_special_tokens": (not self.spaces_between_special_tokens,
                                              "spaces_between_special_tokens=false is not supported"),
            "logits_processors": (self.logits_processors is not None, "logits_processors is not supported"),
            "return_tokens_as_token_ids": (bool(self.return_tokens_as_token_ids),
                                           "return_tokens_as_token_ids is not supported"),
            "return_token_ids": (bool(self.return_token_ids), "return_token_ids is not supported"),
            "cache_salt": (self.cache_salt is not None, "cache_salt is not supported"),
            "kv_transfer_params": (self.kv_transfer_params is not None, "kv_transfer_params is not supported"),
            "vllm_xargs": (self.vllm_xargs is not None, "vllm_xargs is not supported"),
        }
        for name, (bad, message) in refused.items():
            if bad:
                raise RequestError(message, name)

    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0:
            raise RequestError("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
        k = max_model_len if k == -1 else k
        return ids[-k:]


class _SamplingRequest(_DocumentedFields):
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = Field(None, ge=-1, le=_INT32_MAX)
    min_p: Optional[float] = None
    seed: Optional[int] = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted, ignored
    # -- logits processors and structured outputs (OpenAI + vLLM names) --
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # accepted: one backend (llguidance) serves all

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's output constraint from ``structured_outputs``, ``guided_*`` or
        ``response_format`` (at most one of them); RequestError naming the field when malformed."""
        return structured_outputs_from_request(self)

    def make_sampling_params(self, max_tokens: int, logprobs: Optional[int],
                             prompt_logprobs: Optional[int] = None) -> SamplingParams:
        self.check_documented_fields(self.n)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be given when stream is true", "stream_options")
        if self.n > MAX_N:
            raise RequestError(f"n must be <= {MAX_N}, got {self.n}", "n")
        _check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.stream and self.prompt_logprobs:  # vLLM's rule: 0 asks for nothing to stream
            raise RequestError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise RequestError(f"stop must have at most {MAX_STOP} strings, got {len(self.stop)}", "stop")
        kwargs: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params())
        return sampling_params_from(self, kwargs, ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                   "frequency_penalty", "repetition_penalty"))


def _check_logprobs(value: Optional[int], name: str) -> None:
    """At least 0; the most is the server's --max-logprobs (20 by default, OpenAI's cap), checked
    with the engine (serving_engine.verify_logits_fields)."""
    if value is not None and value < 0:
        raise RequestError(f"{name} must be >= 0, got {value}", name)


# ---- /v1/completions -------------------------------------------------------------------------
class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of single prompts (each a string or a token-id list)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    add_special_tokens: bool = True
    prompt_embeds: Optional[Any] = None  # vLLM's; refused

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) without generating (legacy OpenAI)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        _check_logprobs(self.logprobs, "logprobs")
        if self.prompt_embeds is not None:
            raise RequestError("prompt_embeds is not supported; send the prompt as text or token ids", "prompt_embeds")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        echoed = self.logprobs if self.echo and self.logprobs is not None else None  # echo's prompt logprobs
        if self.prompt_logprobs is not None and echoed is not None and self.prompt_logprobs != echoed:
            raise RequestError(f"prompt_logprobs ({self.prompt_logprobs}) and echo with logprobs ({echoed}) must ask "
                               f"for as many logprobs", "prompt_logprobs")
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else echoed
        return self.make_sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed again)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with --enable-prompt-tokens-details: how many prompt tokens were prefix-cache hits (OpenAI's field)
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    # with a reasoning parser: how many of the completion tokens are the thought (OpenAI's field)
    completion_tokens_details: Optional[CompletionTokensDetails] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


def json_logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf (a token ruled out) becomes -9999.0, as in vLLM."""
    return max(value, -9999.0)


class PromptLogprob(OpenAIBaseModel):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob (``json_logprob``), its rank (1:
    the most likely) and its text."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: per prompt token, None (the first) or token id -> PromptLogprob (the
# token itself and the top prompt_logprobs others).
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


def prompt_logprobs_of(positions: Optional[list]) -> Optional[PromptLogprobs]:
    """The engine's prompt logprobs (``RequestOutput.prompt_logprobs``) as the response carries them."""
    if positions is None:
        return None
    return [None if pos is None else {t: PromptLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                                                       decoded_token=lp.decoded_token) for t, lp in pos.items()}
            for pos in positions]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's, when the request asks for them


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None  # the server's (OpenAIServing.system_fingerprint)


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


# ---- /v1/chat/completions --------------------------------------------------------------------
class ChatTextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIBaseModel):
    url: str  # data:image/...;base64,..., file:// (--allowed-local-media-path), http(s):// (--allow-remote-media)
    detail: Optional[str] = None  # OpenAI's "auto" | "low" | "high": accepted, not used


class ChatImagePart(OpenAIBaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[Union[ChatTextPart, ChatImagePart]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None   # assistant turns that called tools
    tool_call_id: Optional[str] = None            # tool turns: which call this answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # An image/audio/file part gets one clear sentence instead of pydantic's union-mismatch dump.
        # (image_url parts are checked by the server, which knows whether the model takes images)
        # A param "content.{j}" is relative to this field: the error names messages.{i}.content.{j}.
        for j, part in enumerate(value if isinstance(value, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "image_url"):
                raise RequestError(f"This model accepts only text and images, so a message content part of type "
                                   f"{kind[:40]!r} cannot be used.", f"content.{j}")
            if kind == "image_url":
                image_url = part.get("image_url")
                if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
                    raise RequestError('an image_url part needs "image_url": {"url": "data:image/png;base64,..."} '
                                       "(an object with a string url)", f"content.{j}")
                if image_url.get("detail") not in (None, "auto", "low", "high"):
                    raise RequestError(f"image_url.detail must be 'auto', 'low' or 'high', got "
                                       f"{str(image_url.get('detail'))[:40]!r}", f"content.{j}")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessageParam":
        # As OpenAI's API: only an assistant turn (tool calls) or a tool turn may come without content.
        if self.content is None and self.role in ("system", "developer", "user"):
            raise RequestError(f"a {self.role} message needs content", "messages")
        return self

    def text_size(self) -> int:
        """Characters of its text (content string or text parts)."""
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p.text) for p in self.content or () if isinstance(p, ChatTextPart))

    def image_urls(self) -> list[tuple[int, str]]:
        """(content part index, URL) of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, p.image_url.url) for j, p in enumerate(self.content) if isinstance(p, ChatImagePart)]

    def to_dict(self, image_text: str = "") -> dict:
        """The message as a chat template reads it; an image part becomes the text ``image_text`` (the
        model's image placeholder, expanded by its processor) in place."""
        d: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list):
            d["content"] = [{"type": "text", "text": p.text if isinstance(p, ChatTextPart) else image_text}
                            for p in self.content]
        else:
            d["content"] = self.content if self.content is not None else ""
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:  # templates (HF convention) expect arguments as a mapping
            d["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # -- tool calling --
    tools: Optional[list[ChatCompletionToolParam]] = None
    tool_choice: Optional[ToolChoice] = None   # default: "auto" with tools, "none" without
    parallel_tool_calls: Optional[bool] = True

    # OpenAI/vLLM chat fields this server refuses when used (see check_chat_fields)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[Any] = None
    echo: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, Any]]] = None
    chat_template: Optional[str] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True  # vLLM's: false drops message.reasoning (with --reasoning-parser)

    def check_chat_fields(self) -> None:
        refused = {
            "functions": (self.functions is not None, "functions is deprecated and not supported; use tools"),
            "function_call": (self.function_call is not None,
                              "function_call is deprecated and not supported; use tool_choice"),
            "audio": (self.audio is not None, "audio output is not supported: this model outputs text"),
            "modalities": (self.modalities is not None and any(m != "text" for m in self.modalities),
                           "only the 'text' modality is supported"),
            "prediction": (self.prediction is not None, "prediction (predicted outputs) is not supported"),
            "verbosity": (self.verbosity is not None, "verbosity is not supported by this model"),
            "web_search_options": (self.web_search_options is not None, "web search is not supported"),
            "echo": (self.echo, "echo is not supported on /v1/chat/completions"),
            "chat_template": (self.chat_template is not None,
                              "a chat_template in the request is not accepted; start the server with --chat-template"),
            "mm_processor_kwargs": (self.mm_processor_kwargs is not None,
                                    "mm_processor_kwargs is not supported: this model is text-only"),
        }
        for name, (bad, message) in refused.items():
            if bad:
                raise RequestError(message, name)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        self.check_chat_fields()
        _check_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.make_sampling_params(max_tokens, logprobs, self.prompt_logprobs)


class ChatMessage(OpenAIBaseModel):
    """An answer's message. ``tool_calls`` is left out when no tool was called, as OpenAI does
    (clients test for the key, not for an empty list)."""

    role: str = "assistant"
    content: Optional[str] = None
    reasoning: Optional[str] = None  # vLLM's field, with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _no_empty_tool_calls(self, handler):
        d = handler(self)
        if not d.get("tool_calls"):
            d.pop("tool_calls", None)
        return d


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None  # the server's (OpenAIServing.system_fingerprint)
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's, when the request asks for them


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # a delta carries only what changed (no empty tool_calls either)
        return {k: v for k, v in handler(self).items() if v is not None and not (k == "tool_calls" and not v)}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


# ---- /v1/models --------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /tokenize, /detokenize ----------------------------------------------------------------------
class TokenizeRequest(RequestBody):
    """Either ``prompt`` (plain text) or ``messages`` (rendered with the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageParam]] = None
    tools: Optional[list[ChatCompletionToolParam]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False  # also each token's string (vLLM's field)

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: Optional[list[str]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # token_strs only when asked for
        return {k: v for k, v in handler(self).items() if v is not None}


class DetokenizeRequest(RequestBody):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class EmbeddingRequest(RequestBody):
    """``/v1/embeddings`` (OpenAI's Embeddings API): ``input`` is a string, a list of strings, a list
    of token ids, or a list of such lists (at most 2,048 inputs, as OpenAI allows), or (vLLM's chat
    form) ``messages``, one conversation rendered with the chat template; ``dimensions``
    keeps the first that many channels and normalizes them again (Matryoshka embeddings);
    ``encoding_format`` "base64" sends each embedding as the base64 of its float32 bytes (little
    endian), as the ``openai`` client asks by default. ``truncate_prompt_tokens`` (vLLM's): keep
    each input's last that many tokens (-1: max_model_len)."""

    model: Optional[str] = None
    input: Optional[Union[str, list[str], list[StrictInt], list[list[StrictInt]]]] = None  # (true is no token id)
    # vLLM's chat form: one conversation rendered with the chat template (no generation prompt by default)
    messages: Optional[list[ChatMessageParam]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, v: Optional[int]) -> Optional[int]:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or at least 1")
        return v
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _input_or_messages(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input or messages")
        return self

    def inputs(self) -> list[Union[str, list[int]]]:
        """The inputs as a list. Raises RequestError when there are none or too many."""
        x = self.input
        items = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        if not items:
            raise RequestError("input must not be empty", "input")
        if len(items) > 2048:
            raise RequestError(f"input has {len(items)} items; the limit is 2048", "input")
        return items


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
