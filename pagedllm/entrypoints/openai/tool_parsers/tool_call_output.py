"""Turns a choice's text into OpenAI tool calls for a request's effective ``tool_choice``: forced
calls (structured outputs) are parsed as JSON, "auto" uses the server's ``--tool-call-parser``.
One ``ToolCallOutput`` per request; ``streamer()`` gives per-choice streaming state."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, NamedToolChoice, ToolCall, random_id)
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_scan import CallDeltas, scan_calls
from pagedllm.entrypoints.openai.tool_parsers.tool_choice import parse_forced_tool_calls


def _finish(finish_reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def one_entry_per_index(calls: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """The tool-call entries of one chunk with at most one entry per ``index`` (OpenAI's and vLLM's
    shape: clients such as instructor read only the first entry of an index): the fragments of one
    index merge into its first entry, which keeps the first id, type and name and the arguments
    joined in order. Entries keep the order of their index's first appearance."""
    merged: dict[int, DeltaToolCall] = {}
    for c in calls:
        into = merged.get(c.index)
        if into is None:
            merged[c.index] = c.model_copy(deep=True)
            continue
        into.id = into.id or c.id
        into.type = into.type or c.type
        if c.function is not None:
            if into.function is None:
                into.function = c.function.model_copy()
            else:
                into.function.name = into.function.name or c.function.name
                if c.function.arguments is not None:
                    into.function.arguments = (into.function.arguments or "") + c.function.arguments
    return list(merged.values())


class ToolCallOutput:
    """``parallel_tool_calls`` False: at most one call ("auto" keeps the parser's first; forced
    choices constrain the output to one)."""

    def __init__(self, tool_choice: Any, parser_cls: Optional[type[ToolParser]], tokenizer,
                 parallel_tool_calls: Optional[bool] = True) -> None:
        self.tool_choice = tool_choice
        self.forced = isinstance(tool_choice, NamedToolChoice) or tool_choice == "required"
        self.parser_cls = parser_cls if tool_choice == "auto" else None
        self.tokenizer = tokenizer
        self.parallel = parallel_tool_calls is not False

    @property
    def reads_harmony_calls(self) -> bool:
        """Whether the calls gpt-oss's reasoning parser leaves in the content are read (else hidden)."""
        return bool(getattr(self.parser_cls, "reads_harmony_calls", False))

    @property
    def active(self) -> bool:
        return self.forced or self.parser_cls is not None

    def whole(self, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[ToolCall], Optional[str]]:
        """(content, tool calls, finish_reason) of one finished choice."""
        if self.forced:
            calls = parse_forced_tool_calls(text, self.tool_choice)
            return (None if calls else text), calls, _finish(finish_reason, bool(calls))
        if self.parser_cls is not None:
            got = self.parser_cls(self.tokenizer).extract_tool_calls(text)
            if got.tools_called:
                calls = got.tool_calls if self.parallel else got.tool_calls[:1]
                return got.content, calls, _finish(finish_reason, True)
        return text, [], finish_reason

    def streamer(self) -> "ToolCallStreamer":
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Streaming state of one choice: ``delta(text so far, finished)`` -> DeltaMessage or None.

    Calls stream as OpenAI and vLLM stream them: a first entry with the call's id, name and the
    arguments so far, then the arguments in fragments as they are generated. A named function's
    output is its arguments; "required"'s array is read by ``scan_calls`` (each item opens a call
    once its name is complete); "auto" follows the parser. Every delta holds at most one entry per
    tool-call index (``one_entry_per_index``). What is sent joins up to ``ToolCallOutput.whole``,
    also when max_tokens cuts a call."""

    def __init__(self, out: ToolCallOutput) -> None:
        self.out = out
        self.parser = out.parser_cls(out.tokenizer) if out.parser_cls is not None else None
        self.sent = 0
        self.called = False
        self.calls = CallDeltas()   # "required": the array's calls opened so far

    def delta(self, text: str, finished: bool) -> Optional[DeltaMessage]:
        d = self._delta(text, finished)
        if d is not None and d.tool_calls:
            d.tool_calls = one_entry_per_index(d.tool_calls)
        return d

    def _delta(self, text: str, finished: bool) -> Optional[DeltaMessage]:
        prev, self.sent = text[:self.sent], len(text)
        new = text[len(prev):]
        if self.parser is not None:
            d = self.parser.extract_tool_calls_streaming(prev, text, new, finished)
            self.called = self.parser.called
            if d is not None and d.tool_calls and not self.out.parallel:  # only the first call's deltas
                d.tool_calls = [c for c in d.tool_calls if c.index == 0] or None
                if d.tool_calls is None and d.content is None and d.role is None:
                    return None
            return d
        tc = self.out.tool_choice
        if isinstance(tc, NamedToolChoice):  # one entry: the first also carries id, type and name
            if not self.called:
                self.called = True
                return DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id=random_id("chatcmpl-tool"), type="function",
                    function=DeltaFunctionCall(name=tc.function.name, arguments=new))])
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new))]) \
                if new else None
        scanned, _ = scan_calls(text, array=True, arg_keys=("parameters",))
        deltas = self.calls.update(scanned)
        self.called = self.called or self.calls.count > 0
        if deltas:
            return DeltaMessage(tool_calls=deltas)
        if finished and not self.called and text:  # not even a name: the output is content
            return DeltaMessage(content=text)
        return None

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        return _finish(finish_reason, self.called)
