"""``tool_choice`` "required" and named functions, forced through structured outputs so the
call always parses (as vLLM does): a named function constrains the output to its ``parameters``
schema (the output *is* the arguments); "required" constrains it to a JSON array of
``{"name": ..., "parameters": {...}}`` (one item unless ``parallel_tool_calls``).

Route-independent: takes the request's tools and tool_choice, returns constraints or calls, so
every route with tools (chat, responses) shares it.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionToolParam, FunctionCall, NamedToolChoice, RequestError, ToolCall)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import opened_calls, scan_calls, sendable_args
from pagedllm.structured_output.params import StructuredOutputsParams, without_additional_properties

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: ChatCompletionToolParam) -> dict[str, Any]:
    """The tool's parameters schema; ``strict: true`` refuses undeclared keys whatever the server's rule."""
    schema = tool.function.parameters or _ANY_OBJECT
    return without_additional_properties(schema) if tool.function.strict else schema


def resolve_tool_choice(tools: Optional[Sequence[ChatCompletionToolParam]], tool_choice: Any,
                        auto_enabled: bool) -> str | NamedToolChoice:
    """The effective choice ("none", "auto", "required" or a named function). RequestError when
    it names an unknown function, needs tools that are absent, or needs auto tool choice off."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice != "none" and not tools:
        raise RequestError(f"tool_choice {_show(tool_choice)} needs tools", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        names = [t.function.name for t in tools or ()]
        if tool_choice.function.name not in names:
            raise RequestError(f"tool_choice names function {tool_choice.function.name!r}, which is not in "
                               f"tools ({', '.join(names)})", "tool_choice")
    if tool_choice == "auto" and not auto_enabled:
        raise RequestError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                           '--tool-call-parser (or send tool_choice "required", "none" or a named function)',
                           "tool_choice")
    return tool_choice


def _show(choice: Any) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else json.dumps(choice)


def tool_choice_structured_outputs(tools: Sequence[ChatCompletionToolParam], tool_choice: Any,
                                   parallel_tool_calls: Optional[bool] = True) -> Optional[StructuredOutputsParams]:
    """The constraint that forces ``tool_choice`` ("required" or named), else None."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)
    if tool_choice != "required":
        return None
    item = {"anyOf": [{"type": "object",
                       "properties": {"name": {"type": "string", "const": t.function.name},
                                      "parameters": _parameters(t)},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    # Compact JSON (as OpenAI's arguments are): no room for a weak model to wander in blanks.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def parse_forced_tool_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """Tool calls from the output of a forced ``tool_choice``. A named function's output is its
    arguments; "required"'s is the array, read by ``scan_calls`` so that the calls are exactly those
    the stream sends: each item whose name is complete is a call, its arguments the JSON text of its
    ``parameters`` as written (compact, as OpenAI's are). An output cut by max_tokens gives the calls
    begun, the last with the arguments written so far."""
    if isinstance(tool_choice, NamedToolChoice):
        return [ToolCall(function=FunctionCall(name=tool_choice.function.name, arguments=text))]
    calls, _ = scan_calls(text, array=True, arg_keys=("parameters",))
    return [ToolCall(function=FunctionCall(name=c.name, arguments=sendable_args(c))) for c in opened_calls(calls)]
