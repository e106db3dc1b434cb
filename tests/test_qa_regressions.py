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
