"""Hermes-style tool calls (NousResearch Hermes 2 Pro, Qwen2.5/Qwen3 templates): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text (vLLM:
``vllm/tool_parsers/hermes_tool_parser.py``). Text outside the tags is the message content."""
from __future__ import annotations

import json
import re
from typing import Optional

from pagedllm.entrypoints.openai.protocol import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from pagedllm.entrypoints.openai.reasoning_parser_base import partial_tail
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ToolParser, register_tool_parser)

START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(START) + r"(.*?)" + re.escape(END) + r"|" + re.escape(START) + r"(.*)$", re.DOTALL)


def parse_call(body: str) -> Optional[ToolCall]:
    """A ToolCall from ``{"name": ..., "arguments": ...}`` text, or None when it does not parse."""
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=args if isinstance(args, str)
                                          else json.dumps(args, ensure_ascii=False)))


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._sent_content = 0   # characters of current_text already sent as content
        self._num_calls = 0

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(False, [], text)
        calls = []
        for m in _CALL_RE.finditer(text):
            call = parse_call(m.group(1) if m.group(1) is not None else m.group(2))
            if call is None:
                return ExtractedToolCalls(False, [], text)  # not a well-formed call: plain text
            calls.append(call)
        content = text[:text.index(START)].strip()
        self.called = bool(calls)
        return ExtractedToolCalls(bool(calls), calls, content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     finished: bool) -> Optional[DeltaMessage]:
        """Content streams as it comes (a possible ``<tool_call>`` prefix and trailing whitespace are
        held back, so the streamed content equals the unstreamed one); each call is sent when its
        closing tag arrives (or at the end): a delta with id, name and its arguments."""
        content_parts: list[str] = []
        tool_deltas: list[DeltaToolCall] = []
        while True:
            rest = current_text[self._sent_content:]
            start = rest.find(START)
            if start < 0:
                hold = 0 if finished else partial_tail(rest, START)
                if not finished:  # trailing whitespace waits: before a call it is stripped, as unstreamed
                    sendable = rest[:len(rest) - hold]
                    hold += len(sendable) - len(sendable.rstrip())
                if len(rest) - hold > 0 and self._num_calls == 0:
                    content_parts.append(rest[:len(rest) - hold])
                if self._num_calls == 0 or finished:
                    self._sent_content += len(rest) - hold
                break
            # The text before the tag, without its trailing whitespace: that stays unsent until the
            # call parses (a malformed call is content, whitespace included).
            pre = len(rest[:start].rstrip())
            if pre and self._num_calls == 0:
                content_parts.append(rest[:pre])
            end = rest.find(END, start)
            if end < 0 and not finished:
                self._sent_content += pre
                break
            body = rest[start + len(START):end if end >= 0 else len(rest)]
            call = parse_call(body)
            if call is None:
                if finished:
                    content_parts.append(rest[pre:])
                    self._sent_content = len(current_text)
                    break
                self._sent_content += pre
                break
            tool_deltas.append(DeltaToolCall(index=self._num_calls, id=call.id, type="function",
                                             function=DeltaFunctionCall(name=call.function.name,
                                                                        arguments=call.function.arguments)))
            self._num_calls += 1
            self.called = True
            self._sent_content += (end + len(END)) if end >= 0 else len(rest)
        content = "".join(content_parts)
        if not content and not tool_deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=tool_deltas or None)
