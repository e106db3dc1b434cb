"""The prebuilt SSE chunks (entrypoints/openai/stream_chunks.py) are byte for byte the chunks pydantic
dumps: completion and chat chunks, random texts with every kind of character JSON escapes."""
import random

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionResponseChoice, CompletionStreamResponse,
    DeltaMessage)
from pagedllm.entrypoints.openai.serving_engine import sse
from pagedllm.entrypoints.openai.stream_chunks import TEXT_SENTINEL, text_chunk

_ALPHABET = ['"', "\\", "/", "\n", "\r", "\t", "\x00", "\x1f", "\x7f", "\u2028", "\u2029", "\ufffd", "é", "漢",
             "\U0001f600", "<", ">", "&", "'", " ", "a", "Z", "0", "{", "}", "\u00a0", "\ud7ff", "\ue000"]


def _texts(n: int = 400):
    rng = random.Random(0)
    yield ""
    for _ in range(n):
        yield "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 12)))


def _completion(text: str, rid: str, model: str, index: int) -> CompletionStreamResponse:
    return CompletionStreamResponse(id=rid, created=1796572490, model=model, system_fingerprint="fp_1",
                                    choices=[CompletionResponseChoice(index=index, text=text)])


def _chat(text: str, rid: str, model: str, index: int) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id=rid, created=1796572490, model=model, system_fingerprint=None,
                                        choices=[ChatCompletionStreamChoice(index=index,
                                                                            delta=DeltaMessage(content=text))])


def test_templates_equal_pydantic_chunks():
    for build in (_completion, _chat):
        for rid, model, index in (("cmpl-abc", "nano", 0), ('id "quoted" \\ é', "m/with\nnewline", 7)):
            template = text_chunk(build(TEXT_SENTINEL, rid, model, index))
            assert template is not None
            for text in _texts():
                assert template(text) == sse(build(text, rid, model, index).model_dump_json()).encode(), text


def test_no_template_when_the_sentinel_is_elsewhere():
    assert text_chunk(_completion(TEXT_SENTINEL, TEXT_SENTINEL, "nano", 0)) is None
    assert text_chunk(_completion("plain", "cmpl-1", "nano", 0)) is None
