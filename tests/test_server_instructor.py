"""instructor (a widely used structured-output client) against a real ``pagedllm serve`` (tiny random
Llama): its TOOLS mode (a named tool_choice), JSON_SCHEMA mode (response_format json_schema) and
``create_partial`` (streamed tool-call arguments, read as they grow: it reads only the first entry of
an index per chunk, so a chunk with two entries of one index broke it). JSON mode (json_object) is
not driven: a random model's object need not match the model's fields."""
from __future__ import annotations

from typing import Literal

import pydantic
import pytest

instructor = pytest.importorskip("instructor")

MODEL = "tiny"


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    unit: Literal["C", "F"]
    sunny: bool


@pytest.fixture(scope="module")
def server(tiny_server):
    """conftest's session server (the tokenizer's own chat template: <|role|>content</s>)."""
    return tiny_server


MSGS = [{"role": "user", "content": "weather in Rome?"}]


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(client, mode):
    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    for seed in (1, 2, 3):
        # (a random model may pad the JSON with the blanks the grammar allows: room for them)
        got = ic.chat.completions.create(model=MODEL, messages=MSGS, response_model=Weather, max_tokens=200,
                                         temperature=1.0, seed=seed, max_retries=0)
        assert isinstance(got, Weather)


def test_instructor_create_partial(client):
    ic = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    partials = list(ic.chat.completions.create_partial(model=MODEL, messages=MSGS, response_model=Weather,
                                                       max_tokens=60, temperature=1.0, seed=4, max_retries=0))
    assert len(partials) > 2  # the arguments arrived in pieces
    final = partials[-1]
    assert final.city in ("Paris", "Rome") and final.unit in ("C", "F") and isinstance(final.sunny, bool)
    whole = ic.chat.completions.create(model=MODEL, messages=MSGS, response_model=Weather, max_tokens=60,
                                       temperature=1.0, seed=4, max_retries=0)
    assert whole.model_dump() == final.model_dump()  # same seed, same call
