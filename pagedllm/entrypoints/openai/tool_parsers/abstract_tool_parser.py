"""Base class and registry of tool-call parsers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from pagedllm.entrypoints.openai.protocol import DeltaMessage, ToolCall

_REGISTRY: dict[str, type["ToolParser"]] = {}


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: Optional[str] = None   # text outside the tool calls (None when empty)


class ToolParser:
    """One parser per choice (it keeps streaming state). Subclasses implement
    ``extract_tool_calls`` (whole text) and ``extract_tool_calls_streaming`` (cumulative text in,
    the delta to send out, or None to send nothing yet)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.called = False  # a tool call was emitted (finish_reason "tool_calls")

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     finished: bool) -> Optional[DeltaMessage]:
        raise NotImplementedError


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        _REGISTRY[name] = cls
        return cls
    return deco


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError listing the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(tool_parser_names())}") from None


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)
