"""Reasoning parsers (``pagedllm serve --reasoning-parser NAME``, as vLLM's ``vllm/reasoning``): split
a reasoning model's output into its chain of thought and its answer, so chat completions return the
thought in ``message.reasoning`` (``delta.reasoning`` when streamed) and the answer in ``content``
(where the tool-call parser then looks for calls), and Responses return a ``reasoning`` output item
before the message.

``openai_gptoss`` reads gpt-oss's harmony channels (``harmony.py``). The other two read the text
between ``<think>`` and ``</think>``:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, Qwen3 "Thinking-2507", QwQ, GLM-Z1, ...): the
  opening tag is optional (these chat templates put it in the prompt); everything up to
  ``</think>`` is reasoning, and an output that never closes it is all reasoning.
- ``qwen3`` (Qwen3's hybrid models, SmolLM3, ...): reasoning only when the output opens with
  ``<think>`` (thinking on); otherwise, as with ``enable_thinking: false``, it is all content.

Streaming splits the text generated so far the same way, holding back a tail that may still grow
into a tag, so the pieces sent add up to the final split.

A constrained output (structured outputs, a forced tool call) follows its grammar from the first
token, so it holds a thought only where the grammar wrote one: it is split as ``qwen3`` splits,
whichever parser is set (``constrained=True``), and JSON or a forced call stays content.
"""
from __future__ import annotations

from typing import Optional

START, END = "<think>", "</think>"


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """split(text, finished) -> (reasoning, content), either None when empty."""

    name = "base"
    start_required = False
    needs_special_tokens = False  # the text must keep special tokens (skip_special_tokens=False)

    def without_tool_calls(self, content: str, finished: bool) -> str:
        """``content`` as shown when no tool parser reads calls out of it (harmony's: without them)."""
        return content

    def split(self, text: str, finished: bool = True, constrained: bool = False) -> tuple[Optional[str], Optional[str]]:
        """The output generated so far (``finished``: all of it) as (reasoning, content); while not
        finished, a tail that may be the beginning of a tag is in neither. ``constrained``: the
        output followed a grammar (the opening tag is then required)."""
        if text.startswith(START):
            body = text[len(START):]
        elif not finished and START.startswith(text):
            return None, None  # "<thi": the opening tag, or not, once more text comes
        elif self.start_required or constrained:
            return None, text or None
        else:
            body = text
        if END in body:
            reasoning, _, content = body.partition(END)
            return reasoning or None, content or None
        if not finished:
            body = body[:len(body) - partial_tail(body, END)]
        return body or None, None

    def reasoning_token_count(self, token_texts: list[str], constrained: bool = False) -> int:
        """How many of a finished output's tokens (each one's text, special tokens kept) are its
        reasoning (usage's ``reasoning_tokens``): those up to and including the one that completes
        ``</think>``; all of them when the thought never closes; none without a thought."""
        text = "".join(token_texts)
        reasoning, _ = self.split(text, True, constrained)
        if reasoning is None:
            return 0
        end = text.find(END)
        if end < 0:
            return len(token_texts)
        end += len(END)
        length = 0
        for i, t in enumerate(token_texts):
            length += len(t)
            if length >= end:
                return i + 1
        return len(token_texts)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start_required = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``. Raises ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


class ReasoningStream:
    """One streamed choice: ``delta(text so far, finished)`` -> (new reasoning, content so far).
    The content so far is what the tool-call streamer or the plain content delta works from."""

    def __init__(self, parser: ReasoningParser, constrained: bool = False) -> None:
        self.parser, self.constrained, self.sent = parser, constrained, 0

    def delta(self, text: str, finished: bool) -> tuple[Optional[str], str]:
        reasoning, content = self.parser.split(text, finished, self.constrained)
        reasoning = reasoning or ""
        new, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        return new or None, content or ""


from pagedllm.entrypoints.openai import harmony  # noqa: E402,F401  (registers openai_gptoss; imports this module)
