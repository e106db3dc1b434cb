"""Does the chat template show the model its tools and its earlier tool calls? Many do not (SmolLM2's
renders neither ``tools`` nor an assistant turn's ``tool_calls``): then "auto" never calls a tool and a
conversation's tool history vanishes from the prompt, with no error anywhere. vLLM gives no sign either.

``probe_template`` renders two probe conversations at start-up, one with a tool definition and one
with an assistant tool call and its result, and looks for the probe's names in the text: the
server logs one warning per model naming what is dropped, and one line per request that carries
tools or tool calls (``TemplateToolSupport.request_note``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from pagedllm.llm import apply_chat_template

logger = logging.getLogger("pagedllm")

_TOOL_NAME = "pagedllm_probe_tool"
_CALL_NAME = "pagedllm_probe_call"
_TOOLS = [{"type": "function", "function": {
    "name": _TOOL_NAME, "description": "a probe of the chat template",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
_QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
_HISTORY = [_QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_probe", "type": "function",
                 "function": {"name": _CALL_NAME, "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_probe", "name": _CALL_NAME, "content": "sunny"}]


@dataclass(frozen=True)
class TemplateToolSupport:
    """What the chat template renders: ``tools`` (the definitions) and ``tool_calls`` (an assistant
    turn's calls); None where the probe could not tell (the template raised on it)."""
    tools: Optional[bool]
    tool_calls: Optional[bool]

    @property
    def dropped(self) -> list[str]:
        """What the template leaves out of the prompt, in words (empty when nothing)."""
        out = []
        if self.tools is False:
            out.append("the tool definitions (tools)")
        if self.tool_calls is False:
            out.append("the assistant's tool calls (tool_calls)")
        return out

    def warning(self, model: str) -> Optional[str]:
        """The start-up warning for ``model``, or None when the template renders both."""
        if not self.dropped:
            return None
        return (f"the chat template of {model} drops {' and '.join(self.dropped)}: requests with tools get a prompt "
                f"without them (tool_choice \"auto\" rarely calls a tool; a conversation's tool history is lost). "
                f"Pass a template that renders them with --chat-template")

    def request_note(self, has_tools: bool, has_calls: bool) -> Optional[str]:
        """The line to log for a request that carries tools and/or earlier tool calls, or None."""
        lost = []
        if has_tools and self.tools is False:
            lost.append("its tools")
        if has_calls and self.tool_calls is False:
            lost.append("its earlier tool calls")
        if not lost:
            return None
        return f"the chat template drops {' and '.join(lost)} from this request's prompt"


def _rendered(tokenizer, template: Optional[str], messages: list[dict], tools: Optional[list]) -> str:
    kwargs = {"tools": tools} if tools else {}
    ids = apply_chat_template(tokenizer, messages, template, add_generation_prompt=True, chat_template_kwargs=kwargs)
    return tokenizer.decode(ids)


def probe_template(tokenizer, template: Optional[str]) -> TemplateToolSupport:
    """Render the probe conversations with ``template`` (None: the tokenizer's own). A template that
    raises on a probe counts as unknown for that part (logged at debug level)."""
    tools: Optional[bool] = None
    calls: Optional[bool] = None
    try:
        tools = _TOOL_NAME in _rendered(tokenizer, template, [_QUESTION], _TOOLS)
    except Exception as e:  # noqa: BLE001 - any template error: the probe cannot tell
        logger.debug("chat template probe (tools) failed: %s: %s", type(e).__name__, e)
    try:
        calls = _CALL_NAME in _rendered(tokenizer, template, _HISTORY, None)
    except Exception as e:  # noqa: BLE001
        logger.debug("chat template probe (tool_calls) failed: %s: %s", type(e).__name__, e)
    return TemplateToolSupport(tools, calls)
