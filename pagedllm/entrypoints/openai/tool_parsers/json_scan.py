"""Reading tool calls out of JSON text that is still being generated, so that their arguments can
stream as the JSON grows (as OpenAI and vLLM stream them) and a call cut by ``max_tokens`` is still
a call, with the arguments written so far.

``scan_calls`` walks the text once, left to right, and stops at the end of the text or at the first
character that cannot continue JSON. What it reports for a prefix of a text is therefore a prefix of
what it reports for the whole text: a name, once complete, never changes, and the arguments only
grow. The streaming side (``CallDeltas``) sends the difference; the whole-text side reads the same
scan of the whole text, so the streamed calls join up to the unstreamed ones exactly.

The arguments are the call's own JSON text for its arguments value (raw, as the model wrote it,
whitespace included), or, where the model wrote them as a JSON string holding JSON, that string's
value once the string is complete (a string is never sent in pieces).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

from pagedllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, random_id

_WS = " \t\r\n"
_LITERAL = set("-+.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ScannedCall:
    """One call object of the text: ``name`` once its string is complete (None before, or when
    the name is not a string); ``args`` its arguments' JSON text so far; ``args_kind`` "object",
    "string" or "other" by the value's first character (None before it starts); ``args_done``
    whether the value is complete; ``end`` the offset just past the object's ``}`` (None while open)."""
    name: Optional[str] = None
    args: str = ""
    args_kind: Optional[str] = None
    args_done: bool = False
    end: Optional[int] = None


def _string_end(text: str, i: int) -> int:
    """Offset just past the string that opens at ``text[i]`` (a quote); -1 when it is not closed."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return -1


def scan_calls(text: str, start: int = 0, array: bool = False,
               arg_keys: Sequence[str] = ARGUMENT_KEYS) -> tuple[list[ScannedCall], Optional[int]]:
    """The call objects of ``text[start:]``: one object (``array`` False) or a JSON array of them.

    Returns (calls, end): ``end`` is the offset just past the top-level value once it is closed,
    else None. Keys other than ``name`` and ``arg_keys`` are skipped; the first of ``arg_keys``
    met in an object is its arguments."""
    calls: list[ScannedCall] = []
    call_depth = 2 if array else 1
    # each open container: [kind ("o"/"a"), expecting a key, the key whose value comes next]
    stack: list[list] = []
    cur: Optional[ScannedCall] = None
    args_start: Optional[int] = None   # where the current call's container-valued arguments opened
    args_depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if not stack and c != ("[" if array else "{"):
            break  # (the stack empties only here, at the start: its closing returns)
        top = stack[-1] if stack else None
        at_call = len(stack) == call_depth and cur is not None
        if c in "{[":
            if at_call and top[2] in arg_keys and args_start is None and cur.args_kind is None:
                cur.args_kind = "object" if c == "{" else "other"
                args_start, args_depth = i, len(stack)
            if c == "{" and len(stack) == call_depth - 1:
                cur = ScannedCall()
                calls.append(cur)
            stack.append(["o" if c == "{" else "a", c == "{", None])
            i += 1
        elif c in "}]":
            if top is None or (top[0] == "o") != (c == "}"):
                break
            stack.pop()
            i += 1
            if args_start is not None and len(stack) == args_depth:
                cur.args, cur.args_done, args_start = text[args_start:i], True, None
            if cur is not None and len(stack) == call_depth - 1:
                cur.end = i
            if not stack:
                return calls, i
        elif c == ":":
            if top is None or top[0] != "o" or top[2] is None:
                break
            top[1] = False
            i += 1
        elif c == ",":
            if top is None:
                break
            if top[0] == "o":
                top[1], top[2] = True, None
            i += 1
        elif c == '"':
            end = _string_end(text, i)
            if end < 0:
                if args_start is not None:  # inside the arguments: the string so far is theirs
                    i = len(text)
                break
            try:
                value = json.loads(text[i:end])
            except ValueError:
                break
            if top is not None and top[0] == "o" and top[1]:
                top[2] = value  # a key
            elif at_call and top[2] == "name" and cur.name is None:
                cur.name = value
            elif at_call and top[2] in arg_keys and cur.args_kind is None:
                cur.args, cur.args_kind, cur.args_done = value, "string", True
            i = end
        elif c in _LITERAL:
            j = i
            while j < len(text) and text[j] in _LITERAL:
                j += 1
            if at_call and top[2] in arg_keys and cur.args_kind is None:
                cur.args_kind = "other"
                cur.args, cur.args_done = text[i:j], j < len(text)
            i = j
        else:
            break
    if args_start is not None:  # the arguments are still open: what is written so far
        cur.args = text[args_start:i]
    return calls, None


class CallDeltas:
    """Streaming state of the calls of one text: ``update(calls)`` gives the ``DeltaToolCall``
    entries that bring the client from what it has to ``calls`` (from ``scan_calls`` of a longer
    text each time). A call is opened (id, type, name and its arguments so far) once its name is
    complete and ``ready(call)`` holds; then its arguments follow as they grow. String-valued
    arguments go out whole once complete. ``index_base`` shifts the indices (calls found in
    several places of a text)."""

    def __init__(self, ready=lambda call: True) -> None:
        self.ready = ready
        self.sent: list[int] = []   # characters of arguments sent, per opened call
        self.ids: list[str] = []

    @property
    def count(self) -> int:
        return len(self.sent)

    def update(self, calls: Sequence[ScannedCall], index_base: int = 0) -> list[DeltaToolCall]:
        out = []
        for k, call in enumerate(calls):
            idx = index_base + k
            if idx >= len(self.sent):
                if idx > len(self.sent) or call.name is None or not self.ready(call):
                    break
                self.ids.append(random_id("chatcmpl-tool"))
                self.sent.append(0)
                args = sendable_args(call)
                self.sent[idx] = len(args)
                out.append(DeltaToolCall(index=idx, id=self.ids[idx], type="function",
                                         function=DeltaFunctionCall(name=call.name, arguments=args)))
                continue
            args = sendable_args(call)
            if len(args) > self.sent[idx]:
                out.append(DeltaToolCall(index=idx, function=DeltaFunctionCall(arguments=args[self.sent[idx]:])))
                self.sent[idx] = len(args)
        return out


def opened_calls(calls: Sequence[ScannedCall], ready=lambda call: True) -> list[ScannedCall]:
    """The calls ``CallDeltas`` opens: those before the first without a complete name (or not ``ready``)."""
    out = []
    for call in calls:
        if call.name is None or not ready(call):
            break
        out.append(call)
    return out


def sendable_args(call: ScannedCall) -> str:
    """The arguments of ``call`` that may go out now: a string value only once complete."""
    if call.args_kind == "string" and not call.args_done:
        return ""
    return call.args
