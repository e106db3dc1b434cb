"""Tool-call parsers, registered by name (``--tool-call-parser NAME``), as in vLLM's
``vllm/tool_parsers``: each turns model text into OpenAI ``tool_calls``, whole or streamed.
``tool_choice`` "required" and named functions do not need a parser: they are forced through
structured outputs (``tool_choice.py``)."""
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls, ToolParser, get_tool_parser, register_tool_parser, tool_parser_names)
from pagedllm.entrypoints.openai.tool_parsers import hermes_tool_parser  # noqa: F401  (registers "hermes")
from pagedllm.entrypoints.openai.tool_parsers import llama3_json_tool_parser  # noqa: F401  (registers "llama3_json")
from pagedllm.entrypoints.openai import harmony  # noqa: E402,F401  (registers "openai")

__all__ = ["ExtractedToolCalls", "ToolParser", "get_tool_parser", "register_tool_parser", "tool_parser_names"]
