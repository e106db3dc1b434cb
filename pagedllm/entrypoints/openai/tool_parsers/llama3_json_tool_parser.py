"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (``--tool-call-parser llama3_json``, vLLM's name; Meta's
"JSON based tool calling" prompt format): the whole answer is one call ``{"name": ..., "parameters":
{...}}`` (``arguments`` also accepted, an object or its JSON text), or several separated by ``;``,
optionally after the ``<|python_tag|>`` token (before the first call or before each). An answer
that does not parse that way is content.

Streaming: an answer that opens with ``{`` (or the tag) is held until it ends, then sent as its calls
(each with id, name and arguments at once) or, if it does not parse, as content; any other answer
streams as content from its first character.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ToolParser, register_tool_parser)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _call(obj: Any) -> Optional[ToolCall]:
    """A call from ``{"name": ..., "parameters"/"arguments": {...}}``; the arguments may be a JSON
    object's text. None for anything else (no name, arguments that are not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)))


def parse_json_calls(text: str) -> Optional[list[ToolCall]]:
    """The calls of a whole answer, or None when it is not one or more JSON calls separated by ``;``."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    calls, i = [], 0
    while i < len(body):
        if body.startswith(PYTHON_TAG, i):  # (a tag before each call)
            i += len(PYTHON_TAG)
            continue
        try:
            obj, i = _DECODER.raw_decode(body, i)
        except ValueError:
            return None
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
    return calls or None


def _may_be_call(text: str) -> bool:
    """Whether an answer beginning with ``text`` (stripped of leading whitespace) may be a call."""
    return text.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(text)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._content_mode = False  # decided: the answer is content, streamed as it comes
        self._sent = 0

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = parse_json_calls(text)
        if calls is None:
            return ExtractedToolCalls(False, [], text or None)
        self.called = True
        return ExtractedToolCalls(True, calls, None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     finished: bool) -> Optional[DeltaMessage]:
        if not self._content_mode:
            head = current_text.lstrip()
            if not finished and (not head or _may_be_call(head)):
                return None  # leading whitespace, or a call being written: wait
            if not finished or not _may_be_call(head):
                self._content_mode = True
            else:
                whole = self.extract_tool_calls(current_text)
                self._sent = len(current_text)
                if not whole.tools_called:
                    return DeltaMessage(content=current_text) if current_text else None
                return DeltaMessage(tool_calls=[
                    DeltaToolCall(index=i, id=c.id, type="function",
                                  function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                    for i, c in enumerate(whole.tool_calls)])
        new, self._sent = current_text[self._sent:], len(current_text)
        return DeltaMessage(content=new) if new else None
