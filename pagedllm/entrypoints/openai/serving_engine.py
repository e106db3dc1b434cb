"""What the completion and chat handlers share: model-name check, tokenization, length checks,
merging the streams of several prompts, and aborting when the HTTP client goes away."""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from typing import Any, AsyncIterator, Awaitable, Optional, TypeVar, Union

from starlette.requests import Request

from pagedllm import __version__
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, RequestError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

T = TypeVar("T")
BIG_PROMPT_CHARS = 16384  # tokenize longer prompts off the event loop
BIG_TOKEN_COUNT = 4096    # and decode (or name) more token ids than this off it too


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Union[int, str, None] = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


def tokenize_error(param: str, e: Exception) -> RequestError:
    """The 400 for a text the tokenizer rejected (``e``). A lone surrogate never gets this far: the
    request models refuse it (protocol.RequestBody)."""
    return RequestError(f"cannot tokenize the {param}: {type(e).__name__}: {str(e)[:200]}", param)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(e: BaseException) -> str:
    if isinstance(e, RequestError):
        body = error_body(e.message, e.type, e.param, e.code)
    elif isinstance(e, EngineDeadError):
        body = error_body(str(e), "service_unavailable", None, "engine_dead")
    else:
        body = error_body(str(e), "invalid_request_error")
    return sse(json.dumps(body))


def system_fingerprint(config: EngineConfig) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and 10 hex digits naming the backend configuration
    that can change outputs (pagedllm's version, the checkpoint, dtype, quantization, KV-cache dtype,
    attention backend, parallel layout, device). Same configuration, same fingerprint: a client
    that sets ``seed`` sees from it whether a changed answer may come from the server."""
    mc, pc = config.model_config, config.parallel_config
    parts = (__version__, mc.model, str(mc.dtype), mc.quantization, config.cache_config.cache_dtype,
             mc.attention_backend, pc.tensor_parallel_size, pc.pipeline_parallel_size, config.device)
    return "fp_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:10]


class OpenAIServing:
    # usage.prompt_tokens_details.cached_tokens: set by the server from --enable-prompt-tokens-details
    enable_prompt_tokens_details: bool = False
    # the base model's and the LoRA adapters' names (serving_models.OpenAIServingModels), set by the server
    models: Optional[Any] = None
    # JSON schemas' undeclared properties: refused (vLLM's default) unless --json-additional-properties allow
    allow_additional_properties: bool = False

    def __init__(self, llm: AsyncLLM, served_model_name: str, chat_template: Optional[str] = None) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.model_config.max_model_len
        self.system_fingerprint = system_fingerprint(llm.engine.config)

    def prompt_tokens_details(self, num_cached_tokens: int) -> Optional[PromptTokensDetails]:
        """usage.prompt_tokens_details: the prompt tokens served from the prefix cache, with
        --enable-prompt-tokens-details (0 when nothing was cached); None without it."""
        return PromptTokensDetails(cached_tokens=num_cached_tokens) if self.enable_prompt_tokens_details else None

    # ---- checks --------------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name not served."""
        if self.models is not None:
            return self.models.resolve(model)
        if model is not None and model != self.served_model_name:
            raise RequestError(f"The model `{model}` does not exist.", "model", 404, "model_not_found")
        return None

    async def tokenize(self, prompt: Union[str, list[int]], param: str = "prompt", offload: bool = False,
                       add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt (text or ids); RequestError when empty or out of vocabulary.
        A long text (or any text with ``offload``) is tokenized off the event loop."""
        if isinstance(prompt, str) and not add_special_tokens:
            encode = functools.partial(self.tokenizer.encode, prompt, add_special_tokens=False)
            try:
                ids = await asyncio.to_thread(encode) if offload or len(prompt) > BIG_PROMPT_CHARS else encode()
            except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the client's text
                raise tokenize_error(param, e) from None
            prompt = ids
        try:
            if isinstance(prompt, str) and (offload or len(prompt) > BIG_PROMPT_CHARS):
                _, ids = await asyncio.to_thread(self.llm.engine.tokenize_prompt, prompt)
            else:
                _, ids = self.llm.engine.tokenize_prompt(prompt)
        except ValueError as e:
            raise RequestError(str(e), param) from None
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the client's text
            raise tokenize_error(param, e) from None
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: Optional[int],
                           prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> int:
        """max_tokens to use; RequestError when the prompt (plus max_tokens) exceeds max_model_len."""
        limit = self.max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
        if num_prompt_tokens > limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens, but the prompt has "
                               f"{num_prompt_tokens} tokens.", prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise RequestError(f"The prompt has {num_prompt_tokens} tokens, which leaves no room for output "
                                   f"within the maximum context length of {limit} tokens.", prompt_param,
                                   code="context_length_exceeded")
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens, but {num_prompt_tokens} "
                               f"prompt tokens plus {max_tokens_param}={max_tokens} were requested.",
                               max_tokens_param, code="context_length_exceeded")
        return max_tokens

    async def verify_logits_fields(self, params: SamplingParams, req, grammar_param: Optional[str] = None) -> None:
        """Token ids in the vocabulary, bad words tokenized, grammar compiled (off the event loop:
        a large schema takes a while; cached after); logprobs within --max-logprobs. RequestError
        naming the field otherwise (``grammar_param``: the field the grammar came from, when the
        caller knows it)."""
        self.resolve_additional_properties(params)
        limit = self.llm.engine.config.model_config.max_logprobs
        name = params.logprobs_above(limit)
        if name:  # named as the client set it (echo's prompt logprobs come from logprobs)
            fields = ("top_logprobs", "logprobs") if name == "logprobs" else (name, "top_logprobs", "logprobs")
            field = next((f for f in fields if getattr(req, f, None) is not None), name)
            raise RequestError(f"{field}={getattr(params, name)} is more than the server allows "
                               f"(--max-logprobs {limit})", field)
        try:
            if params.structured_outputs is not None or params.bad_words:
                await asyncio.to_thread(self.llm.engine.verify_logits_fields, params)
            else:
                self.llm.engine.verify_logits_fields(params)
        except ValueError as e:
            msg = str(e)
            param = next((f for f in ("logit_bias", "allowed_token_ids", "bad_words") if msg.startswith(f)), None)
            if param is None and params.structured_outputs is not None:
                param = grammar_param or next((f for f in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                          "guided_choice", "guided_grammar", "tools", "tool_choice")
                              if getattr(req, f, None) is not None), None)
            raise RequestError(msg, param) from None

    def resolve_additional_properties(self, params: SamplingParams) -> None:
        """The server's rule for undeclared JSON properties (``--json-additional-properties``) where
        the request did not forbid them itself (``disable_additional_properties`` / ``strict``)."""
        so = params.structured_outputs
        if so is not None and so.disable_additional_properties is None:
            so.disable_additional_properties = not self.allow_additional_properties

    def check_limits(self, req) -> None:
        """Request-level checks against the engine (issue 13): stop_token_ids in the vocabulary, and
        ``n`` no more than ``--max-num-seqs`` (its samples must fit in the running batch together)."""
        vocab = self.llm.engine.vocab_size
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[0]}", "stop_token_ids")
        max_num_seqs = self.llm.engine.config.scheduler_config.max_num_seqs
        if req.n > max_num_seqs:
            raise RequestError(f"n={req.n} is more than the server runs at once (--max-num-seqs {max_num_seqs})",
                               "n")

    def check_priority(self, priority: int) -> None:
        """RequestError unless the scheduling policy takes ``priority`` (any value under
        ``--scheduling-policy priority``, only 0 under FCFS)."""
        try:
            self.llm.engine.check_priority(priority)
        except ValueError as e:
            raise RequestError(str(e), "priority") from None

    @staticmethod
    def response_id(req, engine_request_id: str) -> str:
        """The id the client sees: vLLM's ``request_id`` field when given (prefixed like ours), else
        the engine's id. The engine keeps its own unique id, so two clients may reuse one."""
        given = getattr(req, "request_id", None)
        return f"{engine_request_id.split('-', 1)[0]}-{given}" if given else engine_request_id

    def token_text(self, token_id: int) -> str:
        """Text of one token, from the engine's cache of decoded tokens (shared with logprobs)."""
        return self.llm.engine.output_processor.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token: its text's UTF-8, or its own bytes where it holds part of a character."""
        return self.llm.engine.output_processor.token_bytes(token_id)


async def merge_streams(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as ``(stream index, output)``. Closing the merged
    stream cancels (and so aborts) every request still running."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(drain(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (aborting its requests) and
    raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientDisconnected()
    return task.result()
