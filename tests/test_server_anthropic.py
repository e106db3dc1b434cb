"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through a real
``pagedllm serve`` (tiny random Llama), driven by the official ``anthropic`` SDK and httpx: the same
prompt, tokens and tool calls as the equivalent Chat Completions request, Anthropic's SSE events,
stop sequences, tool use (tool_use / tool_result blocks, tool_choice any / tool), errors in
Anthropic's shape, and the API key as ``x-api-key``."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server_utils import RemoteServer

MODEL = "tiny"
KEY = "sk-test-anthropic"
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}{{ c.function.arguments | tojson }}"
            "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"name": "get_weather", "description": "weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                            "unit": {"enum": ["C", "F"]}},
                           "required": ["city", "unit"]}},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                               "required": ["zone"]}}]
SYSTEM = "You answer briefly."
GREEDY = {"temperature": 0}  # (the SDK has no sampling arguments of its own: the body field, as Anthropic's API takes it)
CONVERSATION = [{"role": "user", "content": "the king said"}, {"role": "assistant", "content": "to the queen"},
                {"role": "user", "content": [{"type": "text", "text": "and then"}, {"type": "text", "text": "?"}]}]
CHAT_EQUIVALENT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the king said"},
                   {"role": "assistant", "content": "to the queen"}, {"role": "user", "content": "and then?"}]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    (tmp / "t.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--chat-template", str(tmp / "t.jinja"), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--api-key", KEY)
    with RemoteServer(llama_dir, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def ac(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def openai_http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def chat(openai_http, **body) -> dict:
    r = openai_http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_create_matches_chat_completions(ac, openai_http):
    m = ac.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY)
    want = chat(openai_http, messages=CHAT_EQUIVALENT, max_tokens=12, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == want["choices"][0]["message"]["content"]
    assert m.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == want["usage"]["completion_tokens"] == 12
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    # the system prompt as text blocks renders the same
    m2 = ac.messages.create(model=MODEL, max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                            messages=CONVERSATION, extra_body=GREEDY)
    assert m2.content[0].text == m.content[0].text and m2.usage.input_tokens == m.usage.input_tokens
    counted = ac.messages.count_tokens(model=MODEL, system=SYSTEM, messages=CONVERSATION)
    assert counted.input_tokens == m.usage.input_tokens


def test_stream_events(ac, server):
    kw = dict(model=MODEL, max_tokens=12, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY)
    whole = ac.messages.create(**kw)
    with ac.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [ln[7:] for ln in r.text.splitlines() if ln.startswith("event: ")]
    datas = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[0]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta") == text


def test_stop_sequences(ac):
    kw = dict(model=MODEL, max_tokens=16, messages=CONVERSATION, extra_body=GREEDY)
    text = ac.messages.create(**kw).content[0].text
    words = text.split()
    stop = next(w for w in words[1:] if text.index(w) > 0)
    m = ac.messages.create(stop_sequences=[stop, "zzzz-never"], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]
    with ac.messages.stream(stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])  # (greedy: one call)
def test_tool_use_forced(ac, choice):
    kw = dict(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "weather in Rome?"}], tools=TOOLS,
              tool_choice=choice, extra_body=GREEDY)
    m = ac.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
    use = m.content[0]
    assert use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
    if use.name == "get_weather":
        assert use.input["city"] in ("Paris", "Rome") and use.input["unit"] in ("C", "F")
    with ac.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content] == [(use.name, use.input)]
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert len(partial) > 2 and json.loads("".join(partial)) == use.input  # the input streams as it grows


def test_tool_use_cut_by_max_tokens(ac):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})
    full = ac.messages.create(max_tokens=100, **kw).usage.output_tokens
    m = ac.messages.create(max_tokens=full - 1, **kw)
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "get_weather"


def test_tool_history_reaches_the_template(ac, openai_http):
    """tool_use / tool_result blocks become the assistant's tool_calls and tool messages."""
    history = [{"role": "user", "content": "weather in Rome?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Rome", "unit": "C"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": [{"type": "text", "text": "21 C"}]},
                                            {"type": "text", "text": "thanks"}]}]
    equivalent = [{"role": "user", "content": "weather in Rome?"},
                  {"role": "assistant", "content": "Let me check.", "tool_calls": [
                      {"id": "toolu_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
                  {"role": "user", "content": "thanks"}]
    tools = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                                                                     if "description" in t else {}),
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    ids = openai_http.post("/tokenize", json={"messages": equivalent, "tools": tools}).json()["tokens"]
    text = openai_http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<call toolu_1>get_weather{"city": "Rome", "unit": "C"}' in text and "21 C[toolu_1]" in text
    counted = ac.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert counted.input_tokens == len(ids)
    m = ac.messages.create(model=MODEL, max_tokens=4, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    assert m.usage.input_tokens == len(ids)


def test_errors_have_anthropic_shape(server, ac):
    def post(body, headers=None, path="/v1/messages"):
        return httpx.post(server.url + path, json=body, headers={"x-api-key": KEY, **(headers or {})}, timeout=60)

    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for body, status, kind, words in [
            (base, 400, "invalid_request_error", "max_tokens"),  # max_tokens is required
            ({**base, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
            ({**base, "max_tokens": 4, "model": "nope"}, 404, "not_found_error", "nope"),
            ({**base, "max_tokens": 4, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
             "invalid_request_error", "nope"),
            ({**base, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400,
             "invalid_request_error", "image")]:
        r = post(body)
        assert r.status_code == status, (body, r.text)
        got = r.json()
        assert got["type"] == "error" and got["error"]["type"] == kind and words in got["error"]["message"], got
    r = httpx.post(server.url + "/v1/messages", json={**base, "max_tokens": 4}, timeout=60)  # no key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                           tool_choice={"type": "tool", "name": "nope"})
    # the OpenAI routes keep OpenAI's shape, and take the key as x-api-key too
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 0}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()
