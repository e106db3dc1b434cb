"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each (choice index =
prompt index * n + i), streamed as SSE deltas or returned whole."""
from __future__ import annotations

import codecs
import time
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    MAX_CHOICES, CompletionLogProbs, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionStreamResponse, RequestError, UsageInfo, json_logprob, prompt_logprobs_of, random_id)
from pagedllm.entrypoints.openai.serving_engine import (
    BIG_PROMPT_CHARS, OpenAIServing, merge_streams, run_unless_disconnected, sse, sse_error)
from pagedllm.entrypoints.openai.stream_chunks import TEXT_SENTINEL, text_chunk
from pagedllm.outputs import PositionLogprobs, RequestOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request):
        lora = self.check_model(req.model)
        prompts = req.prompts()
        if len(prompts) * req.n > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts x n={req.n} exceeds the limit of {MAX_CHOICES} "
                               f"completions per request", "n" if req.n > 1 else "prompt")
        prompt_ids: list[list[int]] = []
        params = []
        # Many short prompts add up: tokenize them off the event loop too.
        offload = sum(len(p) for p in prompts if isinstance(p, str)) > BIG_PROMPT_CHARS
        self.check_limits(req)
        self.check_priority(req.priority)
        scoring = req.scores_prompt_only
        for k, p in enumerate(prompts):
            ids = await self.tokenize(p, offload=offload, add_special_tokens=req.add_special_tokens)
            truncated = req.truncate_prompt(ids, self.max_model_len)
            if len(truncated) < len(ids):
                prompts[k] = ids = truncated  # echo shows what the model saw
            # Prompt scoring still samples one token (the engine's unit of work); it is not returned.
            max_tokens = self.resolve_max_tokens(len(ids), 1 if scoring else req.max_tokens)
            prompt_ids.append(ids)
            params.append(req.to_sampling_params(max_tokens))
        if params:
            await self.verify_logits_fields(params[0], req)  # one check: the fields are per request
            for sp in params[1:]:
                sp.bad_words_token_ids = params[0].bad_words_token_ids
                self.resolve_additional_properties(sp)
        prompt_texts: list[Optional[str]] = [
            (p if isinstance(p, str) else self.tokenizer.decode(ids)) if req.echo else None
            for p, ids in zip(prompts, prompt_ids)]
        if scoring:
            return await self._score_prompts(req, raw_request, prompt_ids, prompt_texts, params)
        request_id = random_id("cmpl")
        gens = [self.llm.generate({"prompt_token_ids": ids}, sp, f"{request_id}-{i}", req.priority, lora_request=lora)
                for i, (ids, sp) in enumerate(zip(prompt_ids, params))]
        request_id = self.response_id(req, request_id)  # the client's request_id, if given, names the response
        model = lora.lora_name if lora is not None else self.served_model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(req, request_id, model, gens, prompt_ids, prompt_texts, include_usage),
                media_type="text/event-stream", headers=SSE_HEADERS)

        async def collect() -> list[RequestOutput]:
            final: list = [None] * len(gens)
            async for i, out in merge_streams(gens):
                final[i] = out
            return final

        finals = await run_unless_disconnected(raw_request, collect())
        choices = []
        completion_tokens = 0
        skipped = self._skipped_ids(req)
        for i, out in enumerate(finals):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = c.text
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    if req.echo:
                        self._add_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, 0, skipped=skipped,
                                           limit=len(prompt_texts[i]))
                    offset = len(prompt_texts[i]) if req.echo else 0
                    self._add_logprobs(logprobs, c.token_ids, c.logprobs, offset, skipped=skipped,
                                       limit=offset + len(c.text))
                if req.echo:
                    text = prompt_texts[i] + text
                plp = prompt_logprobs_of(out.prompt_logprobs) if req.prompt_logprobs is not None else None
                choices.append(CompletionResponseChoice(index=i * req.n + c.index, text=text, logprobs=logprobs,
                                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                        prompt_logprobs=plp))
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=num_prompt_tokens + completion_tokens,
                          prompt_tokens_details=self.prompt_tokens_details(sum(o.num_cached_tokens for o in finals)))
        resp = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                  system_fingerprint=self.system_fingerprint)
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _score_prompts(self, req: CompletionRequest, raw_request: Request, prompt_ids: list[list[int]],
                             prompt_texts: list, params: list) -> Response:
        """echo with max_tokens 0: each prompt back, with its logprobs when asked (prompt scoring, as the
        legacy OpenAI completions API allowed). The engine runs only when logprobs (or vLLM's
        prompt_logprobs) are wanted."""
        request_id = random_id("cmpl")
        response_id = self.response_id(req, request_id)
        finals: list = [None] * len(prompt_ids)
        if req.logprobs is not None or req.prompt_logprobs is not None:
            gens = []
            for i, (ids, sp) in enumerate(zip(prompt_ids, params)):
                sp = sp.clone()
                sp.n = 1  # every choice of one prompt scores the same
                gens.append(self.llm.generate({"prompt_token_ids": ids}, sp, f"{request_id}-{i}", req.priority,
                                              lora_request=self.check_model(req.model)))

            async def collect() -> list[RequestOutput]:
                async for i, out in merge_streams(gens):
                    finals[i] = out
                return finals

            await run_unless_disconnected(raw_request, collect())
        choices = []
        skipped = self._skipped_ids(req)
        for i, ids in enumerate(prompt_ids):
            logprobs, plp = None, None
            if finals[i] is not None and req.logprobs is not None:
                logprobs = CompletionLogProbs()
                self._add_logprobs(logprobs, ids, finals[i].prompt_logprobs, 0, skipped=skipped,
                                   limit=len(prompt_texts[i]))
            if finals[i] is not None and req.prompt_logprobs is not None:
                plp = prompt_logprobs_of(finals[i].prompt_logprobs)
            for j in range(req.n):
                choices.append(CompletionResponseChoice(index=i * req.n + j, text=prompt_texts[i],
                                                        logprobs=logprobs, finish_reason="length",
                                                        prompt_logprobs=plp))
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        cached = sum(out.num_cached_tokens for out in finals if out is not None)  # (0: the engine did not run)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=0, total_tokens=num_prompt_tokens,
                          prompt_tokens_details=self.prompt_tokens_details(cached))
        model = self.served_model_name
        fp = self.system_fingerprint
        if not req.stream:
            resp = CompletionResponse(id=response_id, model=model, choices=choices, usage=usage, system_fingerprint=fp)
            return Response(resp.model_dump_json(), media_type="application/json")
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream() -> AsyncIterator[str]:
            for c in choices:
                yield sse(CompletionStreamResponse(id=response_id, created=created, model=model,
                                                   choices=[c], system_fingerprint=fp).model_dump_json())
            if include_usage:
                yield sse(CompletionStreamResponse(id=response_id, created=created, model=model, choices=[],
                                                   usage=usage, system_fingerprint=fp).model_dump_json())
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    def _skipped_ids(self, req: CompletionRequest) -> frozenset:
        """The special tokens a completion's text leaves out (``skip_special_tokens``, the default)."""
        return frozenset(self.tokenizer.all_special_ids) if req.skip_special_tokens else frozenset()

    def _add_logprobs(self, lp: CompletionLogProbs, token_ids: list[int],
                      positions: Optional[list[Optional[PositionLogprobs]]], offset: int,
                      chars: Optional[codecs.IncrementalDecoder] = None, skipped: frozenset = frozenset(),
                      limit: Optional[int] = None) -> int:
        """Append one entry per token to ``lp``; returns the text offset after the last token.
        ``text_offset`` counts the characters the tokens before complete: ``chars`` (a UTF-8
        decoder, carried from one call to the next for one choice's stream) takes each token's bytes,
        so a token holding part of a character starts where that character does; the ids in
        ``skipped`` (special tokens the text leaves out) add none. No offset goes past ``limit``, the
        length of the text returned so far (a last token cut in the middle of a character is held
        back from the text whole, a space before it included)."""
        chars = chars if chars is not None else codecs.getincrementaldecoder("utf-8")("replace")
        positions = positions or []
        for j, tid in enumerate(token_ids):
            pos = positions[j] if j < len(positions) else None
            if pos is None or tid not in pos:
                tok = self.token_text(tid)
                lp.tokens.append(tok)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                tok = pos[tid].decoded_token if pos[tid].decoded_token is not None else self.token_text(tid)
                lp.tokens.append(tok)
                lp.token_logprobs.append(json_logprob(pos[tid].logprob))
                top: dict[str, float] = {}
                for t, v in sorted(pos.items(), key=lambda kv: kv[1].rank or 0):
                    s = v.decoded_token if v.decoded_token is not None else self.token_text(t)
                    top.setdefault(s, json_logprob(v.logprob))
                lp.top_logprobs.append(top)
            lp.text_offset.append(offset if limit is None else min(offset, limit))
            if tid not in skipped:
                offset += len(chars.decode(self.token_bytes(tid)))
        return offset

    async def _stream(self, req: CompletionRequest, request_id: str, model: str, gens: list,
                      prompt_ids: list[list[int]], prompt_texts: list[Optional[str]],
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        num_choices = len(gens) * n
        sent_text = [0] * num_choices
        sent_tokens = [0] * num_choices
        offsets = [0] * num_choices
        decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(num_choices)]
        skipped = self._skipped_ids(req)
        done = [False] * num_choices
        completion_tokens = [0] * num_choices
        continuous = include_usage and req.stream_options.continuous_usage_stats
        cached = [0] * len(gens)  # per prompt: its tokens from the prefix cache
        fp = self.system_fingerprint
        # per choice: its text-only chunk template (stream_chunks.py), made at its first such chunk;
        # False where none can be made
        templates: list = [None] * num_choices
        try:
            async for i, out in merge_streams(gens):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * n + c.index
                    if done[idx]:
                        continue
                    new_text = c.text[sent_text[idx]:]
                    new_ids = c.token_ids[sent_tokens[idx]:]
                    if not new_text and not new_ids and c.finish_reason is None:
                        continue
                    first = sent_tokens[idx] == 0 and sent_text[idx] == 0
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = CompletionLogProbs()
                        base = len(prompt_texts[i]) if req.echo else 0
                        if first and req.echo:
                            self._add_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, 0,
                                               skipped=skipped, limit=base)
                            offsets[idx] = base
                        new_lps = (c.logprobs or [])[sent_tokens[idx]:]
                        offsets[idx] = self._add_logprobs(logprobs, new_ids, new_lps, offsets[idx], decoders[idx],
                                                          skipped, limit=base + len(c.text))
                    elif not new_text and c.finish_reason is None:
                        continue  # text held back (partial stop string / UTF-8); nothing to show yet
                    sent_text[idx] = len(c.text)
                    sent_tokens[idx] = len(c.token_ids)
                    text = (prompt_texts[i] + new_text) if (first and req.echo) else new_text
                    if c.finish_reason is not None:
                        done[idx] = True
                        completion_tokens[idx] = len(c.token_ids)
                    if logprobs is None and c.finish_reason is None and c.stop_reason is None and not continuous:
                        template = templates[idx]
                        if template is None:
                            template = templates[idx] = text_chunk(CompletionStreamResponse(
                                id=request_id, created=created, model=model, system_fingerprint=fp,
                                choices=[CompletionResponseChoice(index=idx, text=TEXT_SENTINEL)])) or False
                        if template:
                            yield template(text)
                            continue
                    usage = None
                    if continuous:  # vLLM's continuous_usage_stats: this choice's usage so far
                        usage = UsageInfo(prompt_tokens=len(prompt_ids[i]), completion_tokens=sent_tokens[idx],
                                          total_tokens=len(prompt_ids[i]) + sent_tokens[idx])
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model, system_fingerprint=fp,
                        choices=[CompletionResponseChoice(index=idx, text=text, logprobs=logprobs,
                                                          finish_reason=c.finish_reason,
                                                          stop_reason=c.stop_reason)], usage=usage)
                    yield sse(chunk.model_dump_json())
            if include_usage:
                num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
                total = sum(completion_tokens)
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], system_fingerprint=fp,
                    usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=total,
                                    total_tokens=num_prompt_tokens + total,
                                    prompt_tokens_details=self.prompt_tokens_details(sum(cached))))
                yield sse(chunk.model_dump_json())
        except Exception as e:  # noqa: BLE001 - report in-band; headers are already sent
            yield sse_error(e)
        yield sse("[DONE]")
