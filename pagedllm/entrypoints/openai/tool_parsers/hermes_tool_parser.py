"""Hermes-style tool calls (NousResearch Hermes 2 Pro, Qwen2.5/Qwen3 templates): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text (vLLM:
``vllm/tool_parsers/hermes_tool_parser.py``). Text outside the tags is the message content."""
from __future__ import annotations

import re
from typing import Optional

from pagedllm.entrypoints.openai.protocol import (
    DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from pagedllm.entrypoints.openai.reasoning_parser_base import partial_tail
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ToolParser, register_tool_parser)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import (
    CallDeltas, ScannedCall, opened_calls, scan_calls, sendable_args)

START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(START) + r"(.*?)" + re.escape(END) + r"|" + re.escape(START) + r"(.*)$", re.DOTALL)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """A call is a ``<tool_call>`` body whose ``name`` is a complete string (``scan_calls``), its
    arguments the JSON text of its ``arguments`` (or ``parameters``) as written; a body cut by
    max_tokens is a call with the arguments so far. A first body without a name makes the whole
    text content (a later one is skipped). Streamed and whole give the same calls."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._sent_content = 0   # characters of current_text already sent as content (or consumed)
        self._num_calls = 0      # calls finished (their closing tag read, or the text ended)
        self._open: Optional[int] = None   # offset of the <tool_call> being read
        self._deltas = CallDeltas()

    @staticmethod
    def _named(body: str) -> Optional[ScannedCall]:
        calls = opened_calls(scan_calls(body)[0][:1])
        return calls[0] if calls else None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(False, [], text)
        calls = []
        for k, m in enumerate(_CALL_RE.finditer(text)):
            call = self._named(m.group(1) if m.group(1) is not None else m.group(2))
            if call is None:
                if k == 0:
                    return ExtractedToolCalls(False, [], text)  # not a call: plain text
                continue
            calls.append(ToolCall(function=FunctionCall(name=call.name, arguments=sendable_args(call))))
        content = text[:text.index(START)].strip()
        self.called = bool(calls)
        return ExtractedToolCalls(bool(calls), calls, content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     finished: bool) -> Optional[DeltaMessage]:
        """Content streams as it comes (a possible ``<tool_call>`` prefix and trailing whitespace are
        held back, so the streamed content equals the unstreamed one); a call opens (id, name,
        arguments so far) once its name is complete, then its arguments stream as they grow."""
        content_parts: list[str] = []
        tool_deltas: list[DeltaToolCall] = []
        while True:
            if self._open is not None:
                body_start = self._open + len(START)
                end = current_text.find(END, body_start)
                stop = end if end >= 0 else len(current_text)
                if end < 0 and not finished:  # a closing tag may be arriving
                    stop -= partial_tail(current_text[body_start:], END)
                closed = end >= 0 or finished
                after = end + len(END) if end >= 0 else len(current_text)
                call = self._named(current_text[body_start:stop])
                if call is None:
                    if not closed:
                        break
                    if self._num_calls == 0:  # a malformed first call: all is content, sent at the end
                        if finished:
                            content_parts.append(current_text[self._sent_content:])
                            self._sent_content, self._open = len(current_text), None
                        break
                    self._sent_content, self._open = after, None  # a malformed later one is skipped
                    continue
                tool_deltas += self._deltas.update([call], index_base=self._num_calls)
                self.called = True
                if not closed:
                    break
                self._num_calls += 1
                self._sent_content, self._open = after, None
                continue
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
            # call has a name (a malformed call is content, whitespace included).
            pre = len(rest[:start].rstrip())
            if pre and self._num_calls == 0:
                content_parts.append(rest[:pre])
            self._open = self._sent_content + start
            self._sent_content += pre
        content = "".join(content_parts)
        if not content and not tool_deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=tool_deltas or None)
