"""Structured outputs, tool calling and the logits fields through a real ``pagedllm serve``
(tiny random Llama, byte-level BPE), driven by the ``openai`` client and httpx. A random model
cannot choose to call a tool, so "auto" is driven by a regex that makes it write a Hermes call."""
from __future__ import annotations

import json
import re
from typing import Literal

import pydantic
import pytest

from server_utils import RemoteServer
from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.entrypoints.openai.tool_parsers.tool_choice import resolve_tool_choice

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}{{ c.function.arguments.city }}"
            "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HERMES = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}</tool_call>'
MSGS = [{"role": "user", "content": "the king said"}]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    (tmp / "t.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--chat-template", str(tmp / "t.jinja"), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3")
    with RemoteServer(llama_dir, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()




def check(obj: dict) -> None:
    assert set(obj) == {"ok", "color"} and isinstance(obj["ok"], bool) and obj["color"] in ("red", "green")


def test_response_format_json_schema_and_object(client):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, n=3, temperature=1.0, seed=1,
                                       response_format=rf)
    for c in r.choices:
        check(json.loads(c.message.content))
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=1.0, seed=2,
                                            response_format=rf, stream=True)
    check(json.loads("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)))
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=1.0, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object prefix
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_vllm_structured_output_fields_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="the king", max_tokens=10, n=4, temperature=1.0, seed=4,
                                  extra_body={"guided_choice": ["yes", "no way"]})
    assert all(c.text in ("yes", "no way") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="the king", max_tokens=10, temperature=1.0, seed=4,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-c]"}})
    assert re.fullmatch("[0-9]{2}-[a-c]", r.choices[0].text)
    stream = client.completions.create(model=MODEL, prompt="the king", max_tokens=200, temperature=1.0, seed=5,
                                       stream=True, extra_body={"guided_json": SCHEMA})
    check(json.loads("".join(c.choices[0].text for c in stream if c.choices)))


def test_openai_sdk_parse_with_pydantic(client):
    class Answer(pydantic.BaseModel):
        ok: bool
        color: Literal["red", "green"]

    r = client.chat.completions.parse(model=MODEL, messages=MSGS, max_tokens=200, temperature=0.8, seed=6,
                                      response_format=Answer)
    assert isinstance(r.choices[0].message.parsed, Answer)


def test_named_and_required_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=1.0, seed=7,
                                       tools=TOOLS, tool_choice=named)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

    stream = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=1.0,
                                                 seed=7, tools=TOOLS, tool_choice=named, stream=True))
    deltas = [d for ch in stream if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # same seed
    assert stream[-1].choices[0].finish_reason == "tool_calls"

    for parallel in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=220, temperature=1.0, seed=8,
                                           tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        calls = r.choices[0].message.tool_calls
        if parallel and r.choices[0].finish_reason == "length":  # a random model may list calls forever
            continue
        assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
        assert len(calls) == 1 or parallel
        for call in calls:
            assert call.function.name in ("get_weather", "get_time") and isinstance(
                json.loads(call.function.arguments), dict)


def test_auto_tool_choice_with_hermes_parser(client):
    body = {"guided_regex": "Sure\\. " + re.escape(HERMES)}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=0, tools=TOOLS,
                                       extra_body=body)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"})]
    stream = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=0,
                                                 tools=TOOLS, extra_body=body, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    deltas = [d for ch in stream if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert content == c.message.content == "Sure." and deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Rome", "unit": "C"}
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none": the same text comes back as content
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=200, temperature=0, tools=TOOLS,
                                       tool_choice="none", extra_body=body)
    assert r.choices[0].message.content == "Sure. " + HERMES and not r.choices[0].message.tool_calls


def test_reasoning_parser_splits_thought_from_answer_and_calls(client, server):
    """--reasoning-parser qwen3: <think>...</think> goes to message.reasoning (delta.reasoning when
    streamed), the rest to content and the tool-call parser; Responses put a reasoning item first.
    Outputs that do not open with <think> (every other test here) stay content."""
    import httpx
    body = {"guided_regex": "<think>[a-z]{4,9} [a-z]{2,6}</think>Sure\\. " + re.escape(HERMES)}
    kw = dict(model=MODEL, messages=MSGS, max_tokens=200, temperature=0, tools=TOOLS, extra_body=body)
    c = client.chat.completions.create(**kw).choices[0]
    thought = c.message.reasoning
    assert re.fullmatch("[a-z]{4,9} [a-z]{2,6}", thought) and c.message.content == "Sure."
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    stream = list(client.chat.completions.create(stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == "Sure."
    assert [d.function.name for d in deltas for d in (d.tool_calls or []) if d.function.name] == ["get_weather"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={**{k: v for k, v in kw.items() if k != "extra_body"}, **body, "include_reasoning": False})
    assert r.json()["choices"][0]["message"]["reasoning"] is None
    # Responses: the reasoning item, then the message, then the call; streamed as events too
    rbody = {"model": MODEL, "input": "the king said", "max_output_tokens": 200, "temperature": 0,
             "text": {"format": {"type": "text"}}, "structured_outputs": {"regex": "<think>[a-z]{3,8}</think>[a-z ]{1,12}"}}
    resp = httpx.post(server.url + "/v1/responses", json=rbody, timeout=60).json()
    assert "output" in resp, resp
    kinds = [item["type"] for item in resp["output"]]
    assert kinds == ["reasoning", "message"], resp
    assert re.fullmatch("[a-z]{3,8}", resp["output"][0]["content"][0]["text"])
    assert "<think>" not in resp["output"][1]["content"][0]["text"]
    events = [json.loads(line[5:]) for line in httpx.post(server.url + "/v1/responses", json={**rbody, "stream": True},
                                                             timeout=60).text.splitlines() if line.startswith("data:")]
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert [e["text"] for e in done] == [resp["output"][0]["content"][0]["text"]]
    # the output sent back as input (reasoning item included) is accepted
    again = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": "hi"}] + resp["output"]
        + [{"role": "user", "content": "and then?"}]})
    assert again.status_code == 200, again.text


def test_auto_tool_choice_keeps_one_call_without_parallel_tool_calls(client):
    """Two Hermes calls in the text: both with parallel_tool_calls (the default), the first alone
    without, streamed or not."""
    second = HERMES.replace("get_weather", "get_time").replace('"city": "Rome", "unit": "C"', '"zone": "UTC"')
    body = {"guided_regex": re.escape(HERMES + second)}
    kw = dict(model=MODEL, messages=MSGS, max_tokens=200, temperature=0, tools=TOOLS, extra_body=body)
    both = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [t.function.name for t in both] == ["get_weather", "get_time"]
    one = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
    assert [t.function.name for t in one.message.tool_calls] == ["get_weather"] and one.finish_reason == "tool_calls"
    stream = list(client.chat.completions.create(parallel_tool_calls=False, stream=True, **kw))
    deltas = [d for ch in stream if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0} and [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Rome", "unit": "C"}


def test_tools_and_tool_history_reach_the_template(http):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    ids = http.post("/tokenize", json={"messages": msgs, "tools": TOOLS}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == ("<|tools|>get_weather;get_time;</s><|user|>weather?</s><|assistant|><call call_1>get_weatherRome"
                    "</s><|tool|>21 C[call_1]</s><|assistant|>")
    r = http.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "tool_choice": "none",
                                                "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)


def test_logit_bias_allowed_token_ids_bad_words(http):
    def text_of(ids):
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    def complete(**body):
        body = {"prompt": "the king", "max_tokens": 5, "temperature": 0, "ignore_eos": True, **body}
        return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

    tok = http.post("/tokenize", json={"prompt": " queen", "add_special_tokens": False}).json()["tokens"][0]
    assert complete(logit_bias={str(tok): 100}) == text_of([tok] * 5)
    a, b = text_of([40]), text_of([41])
    got = complete(temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=[40, 41])
    assert re.fullmatch(f"({re.escape(a)}|{re.escape(b)})+", got), got
    def first_tokens(**body):
        body = {"prompt": "the king", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 0, **body}
        return http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]

    word = first_tokens()[0]
    assert word.strip().isalpha()  # a whole token: the bad word re-tokenizes to it
    assert first_tokens(bad_words=[word])[0] != word


BAD = [
    ({"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
    ({"allowed_token_ids": [100000]}, "allowed_token_ids", "outside the vocabulary"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: nope"}, "guided_grammar", "grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_fields_get_400(http, body, param, words):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and (err["param"] == param or param == "response_format"), err
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_auto_needs_the_server_flags():
    from pagedllm.entrypoints.openai.protocol import ChatCompletionToolParam

    tools = [ChatCompletionToolParam(**t) for t in TOOLS]
    with pytest.raises(RequestError, match="--enable-auto-tool-choice"):
        resolve_tool_choice(tools, None, auto_enabled=False)
    assert resolve_tool_choice(tools, "none", auto_enabled=False) == "none"
    assert resolve_tool_choice(None, None, auto_enabled=False) == "none"


@pytest.mark.parametrize("text", [
    "Sure. " + HERMES, "Let me check.  \n" + HERMES, "plain text  ", "x" + HERMES + " mid " + HERMES,
    "no call <tool", "end <tool_call> {bad", 'end \n<tool_call>{"name": 5}</tool_call> more', " " + HERMES,
    HERMES + "<tool_call>{bad}</tool_call>" + HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'])
def test_hermes_streamed_content_equals_unstreamed(text):
    """Fed in chunks of 1, 3 and 7 characters, the streaming parser sends the content and calls the
    whole-text parser finds: trailing whitespace before a call is held back and dropped (it was
    streamed while the unstreamed content stripped it), and kept before a malformed one."""
    from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser

    whole = HermesToolParser(None).extract_tool_calls(text)
    for step in (1, 3, 7):
        content, calls = stream_through(HermesToolParser(None), text, step)
        assert content == (whole.content or ""), (step, content)
        assert calls == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


def stream_through(parser, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) a streaming parser sends for ``text`` fed ``step`` characters
    at a time, each call's argument fragments joined; checks that a call's first entry carries its
    id and name, later ones only arguments, and the calls open in index order."""
    content, calls, prev = "", [], 0
    for i in [*range(step, len(text), step), len(text)]:
        d = parser.extract_tool_calls_streaming(text[:prev], text[:i], text[prev:i], i == len(text))
        prev = i
        if d is None:
            continue
        content += d.content or ""
        for c in d.tool_calls or []:
            if c.index == len(calls):
                assert c.id and c.function.name, c
                calls.append([c.function.name, c.function.arguments or ""])
            else:
                assert c.index == len(calls) - 1 and c.id is None and c.function.name is None, c
                calls[-1][1] += c.function.arguments
    return content, [tuple(c) for c in calls]


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}'


@pytest.mark.parametrize("text,calls", [
    (LLAMA_CALL, [("get_weather", {"city": "Rome", "unit": "C"})]),
    ("<|python_tag|>" + LLAMA_CALL, [("get_weather", {"city": "Rome", "unit": "C"})]),
    (" \n" + LLAMA_CALL + "; " + '{"name": "get_time", "arguments": {"tz": "CET"}}',
     [("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"tz": "CET"})]),
    ('{"name": "f", "parameters": "{\\"x\\": 1}"}', [("f", {"x": 1})]),
    ("<|python_tag|>" + LLAMA_CALL + ";<|python_tag|>" + LLAMA_CALL,
     [("get_weather", {"city": "Rome", "unit": "C"})] * 2),
    ('{"name": "f", "parameters": "not json"}', None), ('{"name": "", "parameters": {}}', None),
    ('{"name": "f", "parameters": [1]}', None),
    ("It is sunny in Rome.", None), ("  {not json", None), ('{"name": 5}', None),
    (LLAMA_CALL + " and more", [("get_weather", {"city": "Rome", "unit": "C"})]),  # sent: the rest is dropped
    ("<|python", None), ("", None), ("  ", None)])
def test_llama3_json_calls_whole_and_streamed(text, calls):
    """Llama 3.x JSON calls (one, or several separated by ';'; after <|python_tag|>; "parameters" or
    "arguments"); anything else is content. Fed in chunks of 1, 3 and 7 characters, the streaming
    parser sends exactly what the whole-text parser finds."""
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

    cls = get_tool_parser("llama3_json")
    whole = cls(None).extract_tool_calls(text)
    assert whole.tools_called == (calls is not None)
    if calls is None:
        assert whole.content == (text or None) and not whole.tool_calls
    else:
        assert whole.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == calls
    for step in (1, 3, 7):
        parser = cls(None)
        content, got = stream_through(parser, text, step)
        assert content == (whole.content or ""), (step, content)
        assert got == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
        assert parser.called == (calls is not None)


def test_required_tool_choice_streams_and_a_cut_call_is_a_call(client):
    """tool_choice "required": the calls stream as the array grows (one entry per index per chunk,
    arguments in fragments), joined equal to the unstreamed calls (same seed); cut by max_tokens
    inside the arguments, the call comes back as a call with finish_reason "length", streamed or not."""
    kw = dict(model=MODEL, messages=MSGS, temperature=1.0, seed=8, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False)

    def streamed(max_tokens):
        chunks = list(client.chat.completions.create(max_tokens=max_tokens, stream=True, **kw))
        calls, entries = [], 0
        for ch in chunks:
            if not ch.choices:
                continue
            got = ch.choices[0].delta.tool_calls or []
            assert len({d.index for d in got}) == len(got)
            for d in got:
                entries += 1
                if d.index == len(calls):
                    assert d.id and d.function.name
                    calls.append([d.function.name, d.function.arguments or ""])
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index][1] += d.function.arguments or ""
            assert not ch.choices[0].delta.content
        return calls, entries, chunks[-1].choices[0].finish_reason

    r = client.chat.completions.create(max_tokens=220, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    whole = [[t.function.name, t.function.arguments] for t in c.message.tool_calls]
    calls, entries, finish = streamed(220)
    assert calls == whole and finish == "tool_calls" and entries > 2
    for cut_at in range(r.usage.completion_tokens - 1, 0, -1):  # back until the cut is inside the arguments
        cut = client.chat.completions.create(max_tokens=cut_at, **kw).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None, cut
        [t] = cut.message.tool_calls
        assert t.function.name == whole[0][0] and whole[0][1].startswith(t.function.arguments)
        if t.function.arguments != whole[0][1]:
            break
    assert len(t.function.arguments) > 3, t  # (the name and the start of the arguments are still there)
    calls, _, finish = streamed(cut_at)
    assert calls == [[t.function.name, t.function.arguments]] and finish == "length"
