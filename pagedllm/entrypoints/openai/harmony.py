"""gpt-oss's output format, harmony (OpenAI, 2025, "OpenAI Harmony Response Format"), read from the
generated text with its special tokens kept: ``--reasoning-parser openai_gptoss`` (on by default for
gpt-oss) and ``--tool-call-parser openai``, vLLM's names.

A completion is a run of messages, each ``[<|start|>ROLE] <|channel|>CHANNEL [to=RECIPIENT]
[<|constrain|>TYPE] <|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last
two stop generation, so they are not in the text); the recipient may sit in the role part instead
(``<|start|>assistant to=functions.f<|channel|>commentary``). The chat template opens the first
message (``<|start|>assistant``), so the text starts at its channel.

- ``analysis`` bodies are the reasoning (joined by a newline);
- ``final`` bodies, and ``commentary`` ones without a recipient (preambles), are the content;
- a message to ``functions.NAME`` is a tool call: it stays in the content as one canonical segment
  ``<|call|>NAME<|message|>ARGUMENTS<|end|>`` (``<|end|>`` once the call is complete), which the
  ``openai`` tool-call parser turns into ``tool_calls`` (without that parser the segment is left out
  of the content: ``without_tool_calls``).

Plain text before the first header, and text with no ``<|message|>`` at all (a constrained output,
or a model that ignored the format), is content. While generating, a header or marker still
arriving is held back, so the reasoning and the content shown only grow.
"""
from __future__ import annotations

import re
from typing import Optional

from pagedllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from pagedllm.entrypoints.openai.reasoning_parser_base import ReasoningParser, partial_tail
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ToolParser, register_tool_parser)

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
_END_RE = re.compile("|".join(re.escape(t) for t in ENDS + ("<|start|>",)))
_RECIPIENT_RE = re.compile(r"to=([^\s<]+)")
CALL, CALL_END = "<|call|>", "<|end|>"
_CALL_RE = re.compile(re.escape(CALL) + r"(.*?)" + re.escape(MESSAGE) + r"(.*?)(" + re.escape(CALL_END) + r"|$)",
                      re.DOTALL)


def parse_messages(text: str) -> list[tuple[str, Optional[str], str, bool]]:
    """(channel, recipient, body, complete) of each message of ``text``; the last may be incomplete."""
    out, pos = [], 0
    while True:
        at = text.find(MESSAGE, pos)
        if at < 0:
            return out
        header = text[pos:at]
        channel = header.split("<|channel|>", 1)[1] if "<|channel|>" in header else ""
        channel = channel.split("<|constrain|>", 1)[0].split()
        recipient = _RECIPIENT_RE.search(header)
        end = _END_RE.search(text, at + len(MESSAGE))
        body = text[at + len(MESSAGE):end.start() if end else len(text)]
        out.append((channel[0] if channel else "", recipient.group(1) if recipient else None, body, end is not None))
        if end is None:
            return out
        # the next header starts after the terminator, or at a <|start|> that ended this body
        pos = end.start() if end.group(0) == "<|start|>" else end.end()


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss: the analysis channel is the reasoning, the rest the content (see the module)."""

    name = "openai_gptoss"
    needs_special_tokens = True  # the format's markers are special tokens

    def split(self, text: str, finished: bool = True, constrained: bool = False) -> tuple[Optional[str], Optional[str]]:
        messages = parse_messages(text)
        lead = _leading_text(text, finished)
        if not messages:
            return None, lead or None
        reasoning, content = [], [lead]
        for channel, recipient, body, complete in messages:
            if not complete and not finished:  # a marker may be arriving in pieces: hold its start back
                body = body[:len(body) - max(partial_tail(body, t) for t in ENDS + ("<|start|>",))]
            if recipient is not None and recipient.startswith("functions."):
                end = CALL_END if complete or finished else ""
                content.append(f"{CALL}{recipient[len('functions.'):]}{MESSAGE}{body}{end}")
            elif channel == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        return "\n".join(reasoning) or None, "".join(content) or None


    def without_tool_calls(self, content: str, finished: bool) -> str:
        """``content`` without its call segments, for a request whose calls no tool parser reads."""
        return visible_content(content, finished)

    def reasoning_token_count(self, token_texts: list[str], constrained: bool = False) -> int:
        """The tokens of the analysis messages, headers and terminators included (each marker is
        one token): a message's tokens are counted once its ``<|message|>`` shows its channel."""
        count, pending, header, channel = 0, 0, "", None
        for t in token_texts:
            if channel is None:  # in a header (or before the first one)
                pending += 1
                if t != MESSAGE:
                    header += t
                    continue
                fields = header.split("<|channel|>", 1)[1].split("<|constrain|>")[0].split() \
                    if "<|channel|>" in header else []
                channel = fields[0] if fields else ""
                if channel == "analysis" and not _RECIPIENT_RE.search(header):
                    count += pending
                pending, header = 0, ""
                continue
            if t == "<|start|>":  # the next message's header (the body ended without a terminator)
                channel, pending, header = None, 1, t
                continue
            if channel == "analysis":
                count += 1
            if t in ENDS:
                channel = None
        return count


def _leading_text(text: str, finished: bool) -> str:
    """The plain text before the first marker: content, unless it is a recipient in the role part
    (`` to=functions.f<|channel|>...``); while generating, a tail that may still become a marker or
    a recipient is held back."""
    cut = text.find("<|")
    lead = text if cut < 0 else text[:cut]
    stripped = lead.lstrip()
    if stripped.startswith("to="):
        return ""
    if cut < 0 and not finished:
        if not stripped or "to=".startswith(stripped):
            return ""
        lead = lead[:len(lead) - partial_tail(lead, "<|")]
    return lead


def visible_content(content: str, finished: bool) -> str:
    """``content`` with its call segments taken out; while generating, cut where a call (or the
    start of its marker) begins that is not complete yet, so what is shown only grows."""
    text = _CALL_RE.sub(lambda m: m.group(0) if not m.group(3) and not finished else "", content)
    at = text.find(CALL)
    if at >= 0:  # an incomplete call: not shown (finished: it was taken out above)
        text = text[:at]
    elif not finished:
        text = text[:len(text) - partial_tail(text, CALL)]
    return text


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    """The tool calls ``HarmonyReasoningParser`` left in the content as canonical segments; the
    text around them is the content. Streamed: text as it comes; a call opens (id, name, arguments so
    far) once its ``<|message|>`` arrives, then its arguments stream as they grow (a call cut by
    max_tokens is a call with the arguments so far)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.sent_text = 0   # content characters sent
        self.sent_args: list[int] = []  # argument characters sent, per call opened

    @staticmethod
    def _calls(text: str) -> list[tuple[str, str, bool]]:
        return [(m.group(1).strip(), m.group(2), bool(m.group(3))) for m in _CALL_RE.finditer(text)]

    @staticmethod
    def _call(name: str, args: str) -> ToolCall:
        return ToolCall(function=FunctionCall(name=name, arguments=args))  # as written, as the stream sends it

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = [self._call(name, args) for name, args, _ in self._calls(text)]
        content = _CALL_RE.sub("", text)
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls, content=content or None)

    reads_harmony_calls = True  # (the reasoning parser leaves the calls in the content for it)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     finished: bool) -> Optional[DeltaMessage]:
        visible = visible_content(current_text, finished)
        text = visible[self.sent_text:]
        self.sent_text = len(visible)
        deltas = []
        for i, (name, args, complete) in enumerate(self._calls(current_text)):
            if not (complete or finished):  # a closing <|end|> may be arriving
                args = args[:len(args) - partial_tail(args, CALL_END)]
            if i == len(self.sent_args):
                call = self._call(name, args)
                deltas.append(DeltaToolCall(index=i, id=call.id, type="function",
                                            function=DeltaFunctionCall(name=name, arguments=args)))
                self.sent_args.append(len(args))
            elif len(args) > self.sent_args[i]:
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args[self.sent_args[i]:])))
                self.sent_args[i] = len(args)
        self.called = self.called or bool(deltas)
        if not text and not deltas:
            return None
        return DeltaMessage(content=text or None, tool_calls=deltas or None)
