"""Tool calls stream as OpenAI and vLLM stream them, for every way a call is made (a named
function, "required", and "auto" through each parser of the package): a call opens with one entry
carrying id, type and name, its arguments follow in fragments as the JSON grows, each chunk has at
most one entry per index, and the streamed calls join up to the unstreamed ones, also when
max_tokens cuts a call (then it is a call with the arguments written so far and finish_reason
"length")."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.protocol import NamedToolChoice
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.json_scan import scan_calls
from pagedllm.entrypoints.openai.tool_parsers.tool_call_output import ToolCallOutput

REQUIRED = ('[{"name":"get_weather","parameters":{"city":"Rome","unit":"C","days":[1,2]}},'
            '{"name":"get_time","parameters":{"zone":"a \\"quoted\\" }] zone"}}]')
HERMES = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}</tool_call>\n'
          '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
NAMED = '{"city":"Rome","unit":"C"}'


def output_for(kind: str) -> ToolCallOutput:
    if kind == "required":
        return ToolCallOutput("required", None, None)
    if kind == "named":
        return ToolCallOutput(NamedToolChoice(type="function", function={"name": "get_weather"}), None, None)
    return ToolCallOutput("auto", get_tool_parser(kind), None)


def stream(out: ToolCallOutput, text: str, step: int, finish_reason: str):
    """(content, [[name, arguments]], finish_reason, entries) streamed for ``text`` in ``step``-character
    pieces, checking the shape of every chunk."""
    s = out.streamer()
    content, calls, entries, finish = "", [], 0, None
    cuts = [*range(step, len(text), step), len(text)]
    for k, end in enumerate(cuts):
        last = k == len(cuts) - 1
        d = s.delta(text[:end], last)
        finish = s.finish_reason(finish_reason if last else None)
        if d is None:
            continue
        content += d.content or ""
        indices = [c.index for c in d.tool_calls or []]
        assert len(indices) == len(set(indices)), d  # one entry per index per chunk
        for c in d.tool_calls or []:
            entries += 1
            if c.index == len(calls):
                assert c.id and c.type == "function" and c.function.name, c
                calls.append([c.function.name, c.function.arguments or ""])
            else:
                assert c.index < len(calls) and c.id is None and c.function.name is None, c
                calls[c.index][1] += c.function.arguments
    return content, calls, finish, entries


CASES = {"required": REQUIRED, "hermes": HERMES, "llama3_json": LLAMA, "named": NAMED}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_arguments_stream_as_the_json_grows(kind):
    text = CASES[kind]
    out = output_for(kind)
    content, calls, finish = out.whole(text, "stop")
    assert finish == "tool_calls" and calls
    for c in calls:
        assert isinstance(json.loads(c.function.arguments), dict)
    for step in (1, 2, 5):
        got_content, got, got_finish, entries = stream(out, text, step, "stop")
        assert got == [[c.function.name, c.function.arguments] for c in calls], (step, got)
        assert got_content == (content or "") and got_finish == "tool_calls"
        if step == 1:  # fragments, not one delta per call at the end
            assert entries > 3 * len(calls), entries


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(kind):
    """Every cut of the text: the unstreamed calls are the streamed ones; once a call's name is
    complete it is a call, its arguments a prefix of the uncut ones, finish_reason "length"."""
    text = CASES[kind]
    full = output_for(kind).whole(text, "stop")[1]
    seen_cut_call = False
    for end in range(1, len(text)):
        cut = text[:end]
        out = output_for(kind)
        content, calls, finish = out.whole(cut, "length")
        assert finish == "length"
        assert len(calls) <= len(full)
        for c, f in zip(calls, full):
            assert c.function.name == f.function.name and f.function.arguments.startswith(c.function.arguments), \
                (cut, c)
        if calls and calls[-1].function.arguments != full[len(calls) - 1].function.arguments:
            seen_cut_call = True
        for step in (1, 4):
            got_content, got, got_finish, _ = stream(out, cut, step, "length")
            assert got == [[c.function.name, c.function.arguments] for c in calls], (cut, step)
            assert got_finish == "length" and got_content == (content or ""), (cut, step, got_content)
    assert seen_cut_call


def test_required_without_a_complete_name_is_content():
    out = output_for("required")
    assert out.whole('[{"name":"get_we', "length") == ('[{"name":"get_we', [], "length")
    assert stream(out, '[{"name":"get_we', 3, "length")[:3] == ('[{"name":"get_we', [], "length")


def test_parallel_tool_calls_false_keeps_the_first_call_streamed():
    out = ToolCallOutput("auto", get_tool_parser("hermes"), None, parallel_tool_calls=False)
    _, calls, finish, _ = stream(out, HERMES, 3, "stop")
    assert [c[0] for c in calls] == ["get_weather"] and finish == "tool_calls"


@pytest.mark.parametrize("text", [REQUIRED, '[{"name":"f","parameters":{"a":[{"b":"}"}],"c":-1.5e3,"d":true}}]'])
def test_scan_of_a_prefix_is_a_prefix_of_the_scan(text):
    whole, end = scan_calls(text, array=True, arg_keys=("parameters",))
    assert end == len(text) and [json.loads(c.args) for c in whole] == [
        it["parameters"] for it in json.loads(text)]
    for k in range(len(text)):
        part, part_end = scan_calls(text[:k], array=True, arg_keys=("parameters",))
        assert part_end is None and len(part) <= len(whole)
        for p, w in zip(part, whole):
            assert p.name in (None, w.name) and w.args.startswith(p.args), (k, p)
