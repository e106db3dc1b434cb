"""Regressions found by trying the merged work as a new user would (one test per bug)."""
from __future__ import annotations

import pydantic
import pytest

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest


def test_responses_top_k_bounds_match_completions():
    # /v1/completions refuses top_k=-7 (400); /v1/responses accepted it and sampled with top_k disabled.
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest(prompt="x", top_k=-7)
    with pytest.raises(pydantic.ValidationError, match="top_k"):
        ResponsesRequest(input="x", top_k=-7)
    assert ResponsesRequest(input="x", top_k=-1).top_k == -1


def test_responses_aborted_by_the_engine_is_not_completed():
    # At shutdown the engine aborts running requests (finish_reason "abort"). A Responses stream then
    # ended with response.completed / status "completed" after 381 of 1000 tokens, as if nothing was cut.
    import asyncio
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.response_store import ResponseStore
    from pagedllm.entrypoints.openai.responses_protocol import ResponseObject
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, _Run
    from pagedllm.outputs import CompletionOutput, RequestOutput

    def out(text, ids, reason):
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                             outputs=[CompletionOutput(0, text, ids, None, None, reason)], finished=reason is not None)

    async def gen():
        yield out("Hel", [5], None)
        yield out("Hello", [5, 6], "abort")

    async def main():
        serving = OpenAIServingResponses(SimpleNamespace(llm=None), ResponseStore())
        run = _Run(response=ResponseObject(model="m"), history=[], stream=True)
        await serving._produce(run, gen(), 2)
        events = []
        while not run.events.empty():
            events.append(run.events.get_nowait())
        return run.response, events

    resp, events = asyncio.run(main())
    assert resp.status == "failed" and resp.error is not None and "abort" in resp.error.message
    assert resp.output[0].status == "incomplete" and resp.output[0].content[0].text == "Hello"
    assert resp.usage.output_tokens == 2
    assert events[-2]["type"] == "response.failed" and events[-2]["response"]["status"] == "failed"
    assert "response.completed" not in [e.get("type") for e in events[:-1]]
