"""Prebuilt SSE chunks for a stream's common case: a chunk that differs from the stream's other
chunks only in its text (no logprobs, no finish reason, no usage).

Building a ``CompletionStreamResponse`` / ``ChatCompletionStreamResponse`` and dumping it with pydantic
costs 12-35 µs a chunk on this project's 2-core host; with one chunk a token that was the API server
process's largest per-token cost. A ``TextChunk`` is made once per stream from the very pydantic model
the slow path would dump, with a sentinel text: its JSON is cut around the sentinel's JSON into a head
and a tail, and each chunk is then ``head + to_json(text) + tail`` with pydantic-core's own string
encoder (``pydantic_core.to_json``, the encoder ``model_dump_json`` uses). So the bytes are those the
slow path would send (``tests/test_stream_chunks.py`` compares them over random texts).
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel
from pydantic_core import to_json

# A text no real chunk field holds: NUL bytes, which the detokenizer never makes part of an id or a
# model name. If it turns up elsewhere all the same (a client's request_id), there is no template.
TEXT_SENTINEL = "\x00pagedllm-text\x00"


class TextChunk:
    """One stream's SSE chunk with its text left open: ``chunk(text)`` returns the bytes of
    ``data: <the model's JSON with that text>\\n\\n``. Build with :func:`text_chunk`."""

    __slots__ = ("head", "tail")

    def __init__(self, head: bytes, tail: bytes) -> None:
        self.head = head
        self.tail = tail

    def __call__(self, text: str) -> bytes:
        """Raises pydantic_core.PydanticSerializationError for a text pydantic cannot encode (as
        ``model_dump_json`` would)."""
        return self.head + to_json(text) + self.tail


def text_chunk(model: BaseModel) -> Optional[TextChunk]:
    """The template of ``model`` (a stream chunk whose text field holds ``TEXT_SENTINEL``); None when
    the sentinel's JSON is not found exactly once in the model's JSON (then dump each chunk)."""
    dumped = model.model_dump_json().encode()
    quoted = to_json(TEXT_SENTINEL)
    if dumped.count(quoted) != 1:
        return None
    head, _, tail = dumped.partition(quoted)
    return TextChunk(b"data: " + head, tail + b"\n\n")
