"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (``--tool-call-parser llama3_json``, vLLM's name; Meta's
"JSON based tool calling" prompt format): the whole answer is one call ``{"name": ..., "parameters":
{...}}`` (``arguments`` also accepted, an object or its JSON text), or several separated by ``;``,
optionally after the ``<|python_tag|>`` token (before the first call or before each). An answer
that does not parse that way is content.

Read with ``scan_calls`` (``json_scan.py``), so a call opens as soon as its name is complete and its
arguments have begun, then its arguments stream as they grow; a call cut by max_tokens is a call with
the arguments so far, and text after the last call is dropped (it cannot be taken back once sent).
An answer that opens with ``{`` (or the tag) but is not a call is held and sent as content at the
end; any other answer streams as content from its first character.
"""
from __future__ import annotations

import json
from typing import Optional

from pagedllm.entrypoints.openai.protocol import DeltaMessage, FunctionCall, ToolCall
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ToolParser, register_tool_parser)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import (
    CallDeltas, ScannedCall, opened_calls, scan_calls, sendable_args)

PYTHON_TAG = "<|python_tag|>"


def _ready(call: ScannedCall) -> bool:
    """Whether a scanned object is a call: a non-empty name, and arguments that are an object (or a
    string holding one, or absent once the object closes). Once true it stays true as text grows."""
    if not call.name:
        return False
    if call.args_kind == "object":
        return True
    if call.args_kind == "string" and call.args_done:
        try:
            return isinstance(json.loads(call.args), dict)
        except ValueError:
            return False
    if call.args_kind is None and call.end is not None:
        call.args, call.args_kind, call.args_done = "{}", "object", True
        return True
    return False


def scan_json_calls(text: str) -> list[ScannedCall]:
    """The calls of an answer so far (``scan_calls`` of each object, separated by ``;``, whitespace or
    ``<|python_tag|>``), up to the first object that is not a call."""
    calls: list[ScannedCall] = []
    i = 0
    while True:
        while True:  # separators
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if not text.startswith(PYTHON_TAG, i):
                break
            i += len(PYTHON_TAG)
        if i >= len(text) or text[i] != "{":
            return opened_calls(calls, _ready)
        found, end = scan_calls(text, i)
        calls += found[:1]
        if end is None or not found or not _ready(found[0]):
            return opened_calls(calls, _ready)
        i = end


def parse_json_calls(text: str) -> Optional[list[ToolCall]]:
    """The calls of a whole answer (None when it is not one): it must open with a call, after
    optional whitespace and ``<|python_tag|>``; what follows the last call is dropped."""
    calls = scan_json_calls(text)
    if not calls:
        return None
    return [ToolCall(function=FunctionCall(name=c.name, arguments=sendable_args(c))) for c in calls]


def _may_be_call(text: str) -> bool:
    """Whether an answer beginning with ``text`` (stripped of leading whitespace) may be a call."""
    return text.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(text)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._content_mode = False  # decided: the answer is content, streamed as it comes
        self._sent = 0
        self._deltas = CallDeltas(_ready)

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
            if not finished and not head:
                return None  # leading whitespace: wait
            if not _may_be_call(head):
                self._content_mode = True
            else:
                deltas = self._deltas.update(scan_json_calls(current_text))
                if self._deltas.count:
                    self.called = True
                    return DeltaMessage(tool_calls=deltas) if deltas else None
                if not finished:
                    return None  # a call may be being written: wait
                self._sent = len(current_text)  # it was not one: all of it is content
                return DeltaMessage(content=current_text) if current_text else None
        new, self._sent = current_text[self._sent:], len(current_text)
        return DeltaMessage(content=new) if new else None
