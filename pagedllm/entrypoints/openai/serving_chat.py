"""``POST /v1/chat/completions``: messages rendered with the chat template, ``n`` choices,
streamed as ``chat.completion.chunk`` deltas (the first per choice carries the role) or whole."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatLogProb, ChatLogProbsContent, ChatMessage,
    ChatMessageParam, CompletionTokensDetails, DeltaMessage, RequestError, UsageInfo, json_logprob, prompt_logprobs_of,
    random_id)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStream
from pagedllm.entrypoints.openai.serving_completion import SSE_HEADERS
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, run_unless_disconnected, sse, sse_error
from pagedllm.entrypoints.openai.stream_chunks import TEXT_SENTINEL, text_chunk
from pagedllm.entrypoints.openai.tool_parsers.tool_call_output import ToolCallOutput
from pagedllm.entrypoints.openai.template_probe import TemplateToolSupport
from pagedllm.entrypoints.openai.tool_parsers.tool_choice import resolve_tool_choice, tool_choice_structured_outputs
from pagedllm.entrypoints.openai.image_inputs import image_placeholder, image_prompt
from pagedllm.llm import apply_chat_template, render_chat
from pagedllm.outputs import PositionLogprobs

logger = logging.getLogger("pagedllm")

_BIG_CONVERSATION_CHARS = 16384
_BIG_CONVERSATION_MESSAGES = 256  # the template's loop is per message, whatever their size


class OpenAIServingChat(OpenAIServing):
    # Tool calling: set by the server from --enable-auto-tool-choice / --tool-call-parser.
    enable_auto_tools: bool = False
    tool_parser = None  # a ToolParser subclass
    reasoning_parser: Optional[ReasoningParser] = None  # from --reasoning-parser
    template_tools: Optional[TemplateToolSupport] = None  # what the template renders (probed at start-up)

    def note_dropped_tools(self, has_tools: bool, has_calls: bool) -> None:
        """One log line for a request whose tools or tool calls the chat template leaves out."""
        note = self.template_tools.request_note(has_tools, has_calls) if self.template_tools is not None else None
        if note is not None:
            logger.warning(note)

    def split_reasoning(self, text: str, constrained: bool) -> tuple[Optional[str], Optional[str]]:
        """A finished choice's (reasoning, content); without a reasoning parser (None, text).
        ``constrained``: the output followed a grammar (see ``reasoning_parsers``)."""
        if self.reasoning_parser is None:
            return None, text
        return self.reasoning_parser.split(text, True, constrained)

    def reasoning_tokens(self, token_ids: list[int], constrained: bool) -> int:
        """How many of a finished choice's tokens are its thought (0 without a reasoning parser)."""
        if self.reasoning_parser is None or not token_ids:
            return 0
        return self.reasoning_parser.reasoning_token_count([self.token_text(t) for t in token_ids], constrained)

    def reasoning_details(self, choices_token_ids: list[list[int]], constrained: bool
                          ) -> Optional[CompletionTokensDetails]:
        """usage.completion_tokens_details of finished choices: their reasoning tokens, summed (None
        without a reasoning parser)."""
        if self.reasoning_parser is None:
            return None
        return CompletionTokensDetails(reasoning_tokens=sum(self.reasoning_tokens(ids, constrained)
                                                            for ids in choices_token_ids))

    def reasoning_effort(self, effort: str, param: str) -> str:
        """``effort`` for a chat template that reads ``reasoning_effort`` (gpt-oss's: low, medium,
        high); RequestError when the template does not."""
        if effort not in ("low", "medium", "high"):
            raise RequestError(f"{param} must be 'low', 'medium' or 'high', got {effort!r}", param)
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        if "reasoning_effort" not in str(template):
            raise RequestError(f"{param} is not supported by this model (its chat template has no reasoning_effort)",
                               param)
        return effort

    def render(self, messages: list[ChatMessageParam], add_generation_prompt: Optional[bool] = True,
               continue_final_message: bool = False, chat_template_kwargs: Optional[dict] = None,
               tools: Optional[list] = None, image_text: Optional[str] = None):
        """Token ids of the conversation; RequestError when the template cannot render it.
        ``tools`` (OpenAI tool definitions) reach the template as ``tools``. ``image_text`` given: the
        rendered text instead, each image part written as ``image_text`` (the model's placeholder)."""
        self.note_dropped_tools(bool(tools), any(m.tool_calls for m in messages))
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs.setdefault("tools", [t.model_dump(exclude_none=True) for t in tools])
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true: the first "
                               "continues the last message, the second starts a new one", "continue_final_message")
        # None = not given: on, unless the final message is continued
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        try:
            render = apply_chat_template if image_text is None else render_chat
            return render(self.tokenizer, [m.to_dict(image_text or "") for m in messages], self.chat_template,
                          add_generation_prompt=bool(add_generation_prompt),
                          continue_final_message=continue_final_message, chat_template_kwargs=kwargs)
        except Exception as e:  # noqa: BLE001 - template errors come from user content/kwargs
            raise RequestError(f"cannot apply the chat template: {type(e).__name__}: {e}", "messages") from None

    async def render_async(self, req) -> tuple[list[int], dict]:
        """(prompt token ids, the engine's prompt): the rendered conversation, with its images (image_url
        parts) loaded and processed when it has any (RequestError naming a part that cannot be used)."""
        parts = [(f"messages.{i}.content.{j}", url) for i, m in enumerate(req.messages) for j, url in m.image_urls()]
        if not parts:
            ids = await self.render_ids_async(req)
            return ids, {"prompt_token_ids": ids}
        image_placeholder(self.llm.engine, parts[0][0], "image_url")  # (400 for a text-only model)
        return await image_prompt(self.llm.engine, parts,
                                  lambda placeholder: self.render(*self.render_args(req), image_text=placeholder))

    def render_args(self, req) -> tuple:
        # add_generation_prompt defaults to true; only an explicit true conflicts with continue_final_message
        agp = req.add_generation_prompt if "add_generation_prompt" in req.model_fields_set else None
        kwargs = req.chat_template_kwargs
        if getattr(req, "documents", None) is not None:  # vLLM's RAG documents, given to the template
            kwargs = {**(kwargs or {}), "documents": req.documents}
        if getattr(req, "reasoning_effort", None) is not None:
            kwargs = {**(kwargs or {}), "reasoning_effort": self.reasoning_effort(req.reasoning_effort,
                                                                                  "reasoning_effort")}
        return req.messages, agp, req.continue_final_message, kwargs, getattr(req, "tools", None)

    async def render_ids_async(self, req) -> list[int]:
        args = self.render_args(req)
        size = sum(m.text_size() for m in req.messages)
        if size > _BIG_CONVERSATION_CHARS or len(req.messages) > _BIG_CONVERSATION_MESSAGES:
            return await asyncio.to_thread(self.render, *args)
        return self.render(*args)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request):
        lora = self.check_model(req.model)
        ids, prompt = await self.render_async(req)
        if not ids:
            raise RequestError("the rendered conversation is empty", "messages")
        if req.add_special_tokens:
            raise RequestError("add_special_tokens=true is not supported on chat: the chat template adds the "
                               "model's special tokens", "add_special_tokens")
        self.check_limits(req)
        if "mm_inputs" in prompt and req.truncate_prompt(ids, self.max_model_len) != ids:
            raise RequestError("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
        ids = req.truncate_prompt(ids, self.max_model_len)
        if "prompt_token_ids" in prompt:
            prompt = {"prompt_token_ids": ids}
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(ids), req.requested_max_tokens(), "messages", param)
        params = req.to_sampling_params(max_tokens)
        if self.reasoning_parser is not None and self.reasoning_parser.needs_special_tokens:
            params.skip_special_tokens = False  # gpt-oss's channels are special tokens
        tools = self.tool_call_output(req, params)
        await self.verify_logits_fields(params, req)
        request_id = random_id("chatcmpl")
        self.check_priority(req.priority)
        gen = self.llm.generate(prompt, params, request_id, req.priority, lora_request=lora)
        request_id = self.response_id(req, request_id)  # the client's request_id, if given, names the response
        model = lora.lora_name if lora is not None else self.served_model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            constrained = params.structured_outputs is not None
            return StreamingResponse(self._stream(req, request_id, model, gen, len(ids), include_usage, tools,
                                                  constrained),
                                     media_type="text/event-stream", headers=SSE_HEADERS)

        async def collect():
            final = None
            async for out in gen:
                final = out
            return final

        out = await run_unless_disconnected(raw_request, collect())
        choices = []
        completion_tokens = 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs:
                logprobs = ChatCompletionLogProbs(content=self.logprob_entries(c.token_ids, c.logprobs,
                                                                         req.top_logprobs or 0))
            reasoning, text = self.split_reasoning(c.text, params.structured_outputs is not None)
            if text is not None and self.reasoning_parser is not None and not tools.reads_harmony_calls:
                text = self.reasoning_parser.without_tool_calls(text, True) or None
            content, tool_calls, finish_reason = tools.whole(text or "", c.finish_reason)
            message = ChatMessage(content=None if text is None else content, tool_calls=tool_calls,
                                  reasoning=reasoning if req.include_reasoning else None)
            choices.append(ChatCompletionResponseChoice(index=c.index, message=message,
                                                        logprobs=logprobs, finish_reason=finish_reason,
                                                        stop_reason=c.stop_reason))
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens,
                          prompt_tokens_details=self.prompt_tokens_details(out.num_cached_tokens),
                          completion_tokens_details=self.reasoning_details(
                              [c.token_ids for c in out.outputs], params.structured_outputs is not None))
        plp = prompt_logprobs_of(out.prompt_logprobs) if req.prompt_logprobs is not None else None
        resp = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                      system_fingerprint=self.system_fingerprint, prompt_logprobs=plp)
        return Response(resp.model_dump_json(), media_type="application/json")

    def tool_call_output(self, req: ChatCompletionRequest, params) -> ToolCallOutput:
        """Resolve ``tool_choice``; a forced choice becomes the request's structured output."""
        choice = resolve_tool_choice(req.tools, req.tool_choice, self.enable_auto_tools and self.tool_parser is not None)
        forced = tool_choice_structured_outputs(req.tools or [], choice, req.parallel_tool_calls)
        if forced is not None:
            if params.structured_outputs is not None:
                raise RequestError("a forced tool_choice cannot be combined with response_format or structured "
                                   "outputs", "tool_choice")
            params.structured_outputs = forced
        return ToolCallOutput(choice, self.tool_parser, self.tokenizer, req.parallel_tool_calls)

    def logprob_entries(self, token_ids: list[int], positions: Optional[list[PositionLogprobs]],
                        top_n: int) -> list[ChatLogProbsContent]:
        """OpenAI's logprob entry of each token (its text, logprob, bytes and ``top_n`` alternatives);
        tokens without logprobs are skipped. Chat's ``logprobs.content`` and Responses' text parts."""
        out = []
        positions = positions or []
        for tid, pos in zip(token_ids, positions):
            if pos is None or tid not in pos:
                continue
            entry = pos[tid]
            tok = entry.decoded_token if entry.decoded_token is not None else self.token_text(tid)
            tops = sorted(pos.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
            top = [ChatLogProb(token=(v.decoded_token if v.decoded_token is not None else self.token_text(t)),
                               logprob=json_logprob(v.logprob), bytes=list(self.token_bytes(t)))
                   for t, v in tops]
            out.append(ChatLogProbsContent(token=tok, logprob=json_logprob(entry.logprob),
                                           bytes=list(self.token_bytes(tid)), top_logprobs=top))
        return out

    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str, gen,
                      num_prompt_tokens: int, include_usage: bool,
                      tools: Optional[ToolCallOutput] = None, constrained: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        sent_text = [0] * n
        sent_tokens = [0] * n
        done = [False] * n
        completion_tokens = [0] * n
        final_ids: list[list[int]] = [[] for _ in range(n)]
        streamers = [tools.streamer() for _ in range(n)] if tools is not None and tools.active else None
        thoughts = [ReasoningStream(self.reasoning_parser, constrained) for _ in range(n)] \
            if self.reasoning_parser is not None else None

        continuous = include_usage and req.stream_options.continuous_usage_stats
        num_cached = 0  # prompt tokens from the prefix cache (known once the request is scheduled)

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            # vLLM's continuous_usage_stats: every chunk carries the usage of its choice so far
            usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=sent_tokens[choice.index],
                              total_tokens=num_prompt_tokens + sent_tokens[choice.index]) if continuous else None
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=[choice], usage=usage,
                                                    system_fingerprint=self.system_fingerprint).model_dump_json())

        # per choice: its content-only chunk template (stream_chunks.py), made at its first such chunk;
        # False where none can be made
        templates: list = [None] * n
        try:
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for out in gen:
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    text, reasoning = c.text, None
                    if thoughts is not None:  # the content so far is what follows the reasoning
                        reasoning, text = thoughts[i].delta(c.text, c.finish_reason is not None)
                        reasoning = reasoning if req.include_reasoning else None
                        if tools is None or not tools.reads_harmony_calls:
                            text = self.reasoning_parser.without_tool_calls(text, c.finish_reason is not None)
                    new_text = text[sent_text[i]:]
                    new_ids = c.token_ids[sent_tokens[i]:]
                    has_lp = req.logprobs and bool(new_ids)
                    if not new_text and not reasoning and not has_lp and c.finish_reason is None:
                        continue
                    logprobs = None
                    if req.logprobs:
                        new_lps = (c.logprobs or [])[sent_tokens[i]:]
                        logprobs = ChatCompletionLogProbs(content=self.logprob_entries(new_ids, new_lps,
                                                                                 req.top_logprobs or 0))
                    sent_text[i] = len(text)
                    sent_tokens[i] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done[i] = True
                        completion_tokens[i] = len(c.token_ids)
                        final_ids[i] = c.token_ids
                    if logprobs is None and thoughts is None and streamers is None and c.finish_reason is None \
                            and c.stop_reason is None and not continuous:
                        template = templates[i]
                        if template is None:
                            template = templates[i] = text_chunk(ChatCompletionStreamResponse(
                                id=request_id, created=created, model=model, system_fingerprint=self.system_fingerprint,
                                choices=[ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=TEXT_SENTINEL))]
                            )) or False
                        if template:
                            yield template(new_text)
                            continue
                    delta, finish_reason = DeltaMessage(content=new_text), c.finish_reason
                    if thoughts is not None:  # a reasoning step sends no empty content
                        delta = DeltaMessage(content=new_text or None)
                    if streamers is not None:  # tool calls: the parser decides what goes out
                        delta = streamers[i].delta(text, c.finish_reason is not None) or DeltaMessage()
                        finish_reason = streamers[i].finish_reason(c.finish_reason)
                        if delta.content is None and delta.tool_calls is None and finish_reason is None \
                                and not reasoning and not (logprobs and logprobs.content):
                            continue
                    delta.reasoning = reasoning
                    yield chunk(ChatCompletionStreamChoice(
                        index=i, delta=delta, logprobs=logprobs,
                        finish_reason=finish_reason, stop_reason=c.stop_reason))
            if include_usage:
                total = sum(completion_tokens)
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], system_fingerprint=self.system_fingerprint,
                    usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=total,
                                    total_tokens=num_prompt_tokens + total,
                                    prompt_tokens_details=self.prompt_tokens_details(num_cached),
                                    completion_tokens_details=self.reasoning_details(final_ids, constrained)
                                    )).model_dump_json())
        except Exception as e:  # noqa: BLE001 - report in-band; headers are already sent
            yield sse_error(e)
        yield sse("[DONE]")
