"""The reasoning parsers' common part (``reasoning_parsers.py`` registers them by name): the base
class, which splits ``<think>...</think>``, and ``partial_tail``, the length of a tag's beginning a
streamed text may end with (held back until the next token says whether the tag arrives). A module
of its own so that the parsers of other formats (``harmony.py``) and the tool-call parsers can
subclass and use it without importing the registry that imports them."""
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
