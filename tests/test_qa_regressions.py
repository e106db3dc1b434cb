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


def test_max_model_len_beyond_the_rope_table_is_a_clear_error(tmp_path):
    # `pagedllm serve --max-model-len 99999` on the demo model (max_position_embeddings=1024) died at
    # start-up with "IndexError: index 1024 is out of bounds" from the RoPE table during profiling.
    from conftest import build_checkpoint
    from pagedllm import LLM

    d = build_checkpoint(str(tmp_path / "llama"), max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_position_embeddings=64.*max_model_len=128"):
        LLM(d, max_model_len=128, kv_cache_memory=1 << 20)
    llm = LLM(d, max_model_len=64, kv_cache_memory=1 << 20)  # the table's own length is served
    from pagedllm import SamplingParams
    out = llm.generate([{"prompt_token_ids": [7] * 60}], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"
