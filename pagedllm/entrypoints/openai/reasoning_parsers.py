"""Reasoning parsers (``pagedllm serve --reasoning-parser NAME``, as vLLM's ``vllm/reasoning``): split
a reasoning model's output into its chain of thought and its answer, so chat completions return the
thought in ``message.reasoning`` (``delta.reasoning`` when streamed) and the answer in ``content``
(where the tool-call parser then looks for calls), and Responses return a ``reasoning`` output item
before the message.

``openai_gptoss`` reads gpt-oss's harmony channels (``harmony.py``). The other two read the text
between ``<think>`` and ``</think>`` (their base class, ``reasoning_parser_base.py``):

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

from pagedllm.entrypoints.openai.harmony import HarmonyReasoningParser
from pagedllm.entrypoints.openai.reasoning_parser_base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start_required = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)}


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
