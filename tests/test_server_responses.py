"""The Responses API (``/v1/responses``), black-box: a real ``pagedllm serve`` process with an API key,
driven with the official ``openai`` client (``responses.create``, ``.stream``, ``previous_response_id``,
``.retrieve``, ``.delete``, ``.cancel``) and with ``httpx`` for the error paths."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.responses_protocol import LOGPROBS_INCLUDE, ResponseObject
from server_utils import RemoteServer, metric, wait_idle

KEY = "resp-key"
MODEL = "tiny"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
# Renders tool calls and tool results, so a history that dropped them would count fewer tokens.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] %}{{ m['content'] }}{% endif %}"
            "{% for c in m.get('tool_calls') or [] %}call {{ c['id'] }} {{ c['function']['name'] }} "
            "{{ c['function']['arguments'] | tojson }}{% endfor %}"
            "{% if m.get('tool_call_id') %} for {{ m['tool_call_id'] }}{% endif %}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("responses")
    (d / "template.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-memory", "4MiB",
            "--api-key", KEY, "--disable-access-log", "--chat-template", str(d / "template.jinja"),
            "--max-stored-responses", "6")
    with RemoteServer(llama_dir, args, log_path=str(d / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()




@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def n_template_tokens(tokenizer, messages) -> int:
    return len(tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True,
                                             tokenize=True, return_dict=False))




def test_create_equals_chat_completion(client, tokenizer):
    r = client.responses.create(model=MODEL, input="to be or not", instructions="answer briefly",
                                max_output_tokens=12, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, **GREEDY, messages=[
        {"role": "system", "content": "answer briefly"}, {"role": "user", "content": "to be or not"}])
    assert r.object == "response" and r.id.startswith("resp")
    assert r.output_text == chat.choices[0].message.content
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    # max_output_tokens reached: incomplete, as OpenAI reports it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.completed_at is None
    assert r.usage.output_tokens == 12 == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens == n_template_tokens(
        tokenizer, [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "to be or not"}])
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.instructions == "answer briefly" and r.max_output_tokens == 12


def test_logprobs_equal_chat_completions(client, http):
    """include message.output_text.logprobs with top_logprobs: each output token's entry, as the
    chat route gives it for the same conversation; streamed deltas carry theirs in order."""
    kw = dict(model=MODEL, input="to be or not", max_output_tokens=6, **GREEDY)
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY,
                                          messages=[{"role": "user", "content": "to be or not"}])
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert len(got) == 6 and [(g.token, g.logprob, g.bytes) for g in got] == [(w.token, w.logprob, w.bytes) for w in want]
    assert [[(t.token, t.logprob) for t in g.top_logprobs] for g in got] == \
        [[(t.token, t.logprob) for t in w.top_logprobs] for w in want]
    events = list(client.responses.create(stream=True, include=["message.output_text.logprobs"], top_logprobs=2, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(g.token, g.logprob) for g in got]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [g.token for g in got]
    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # not asked for
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    for body, param in (({"top_logprobs": 21}, "top_logprobs"), ({"service_tier": "flex"}, "service_tier"),
                        ({"include": [LOGPROBS_INCLUDE, "file_search_call.results"]}, "include"),
                        ({"top_logprobs": 2, "tools": [tool], "tool_choice": "required"}, "top_logprobs")):
        err = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})
        assert err.status_code == 400 and err.json()["error"]["param"] == param


def test_message_items_and_tool_history_reach_the_template(client, tokenizer):
    items = [
        {"role": "developer", "content": "be terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what is "},
                                                         {"type": "input_text", "text": "the weather"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=4, **GREEDY)
    expected = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "what is the weather"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert r.usage.input_tokens == n_template_tokens(tokenizer, expected)
    # the same text as a plain string counts the same
    flat = client.responses.create(model=MODEL, input=[{"role": "user", "content": "what is the weather"}],
                                   max_output_tokens=4, **GREEDY)
    assert flat.usage.input_tokens == n_template_tokens(tokenizer, [expected[1]])


def test_stream_events_match_the_final_response(client):
    kwargs = dict(model=MODEL, input="the quick brown", max_output_tokens=10, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 10
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    # the SDK's stream helper reads the same events (its get_final_response() needs response.completed,
    # which a response cut at max_output_tokens does not send: see the SmolLM2 test)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].type == "response.incomplete"


def test_previous_response_id_continues_the_conversation(client, tokenizer):
    first = client.responses.create(model=MODEL, input="hello there", instructions="sys one",
                                    max_output_tokens=6, **GREEDY)
    second = client.responses.create(model=MODEL, input="and then", previous_response_id=first.id,
                                     max_output_tokens=6, **GREEDY)
    # instructions are not carried over; the first output is
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "and then"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == n_template_tokens(tokenizer, history)
    # prefix caching: the first conversation's blocks are reused (the tiny model uses 16-token blocks)
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text and got.status == second.status
    third = client.responses.create(model=MODEL, input="again", previous_response_id=second.id,
                                    max_output_tokens=3, **GREEDY)
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "again"}]
    assert third.usage.input_tokens == n_template_tokens(tokenizer, history)


def test_store_false_delete_and_unknown_ids(client, http):
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False, **GREEDY)
    assert r.store is False
    resp = http.get(f"/v1/responses/{r.id}")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    kept = client.responses.create(model=MODEL, input="y", max_output_tokens=2, **GREEDY)
    deleted = client.responses.delete(kept.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    body = http.delete(f"/v1/responses/{kept.id}")
    assert body.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_store_keeps_at_most_max_count(client):
    ids = [client.responses.create(model=MODEL, input=f"n {i}", max_output_tokens=1, **GREEDY).id for i in range(7)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])   # --max-stored-responses 6: the oldest is gone
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_background_response_completes_and_cancel(client, http):
    bg = client.responses.create(model=MODEL, input="count", max_output_tokens=5, background=True, **GREEDY)
    assert bg.status in ("queued", "in_progress") and bg.background
    deadline = time.time() + 60
    while (got := client.responses.retrieve(bg.id)).status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.1)
    assert got.status == "incomplete" and got.usage.output_tokens == 5
    # a long one, cancelled: its KV blocks are freed and it stays cancelled
    long = client.responses.create(model=MODEL, input="go on", max_output_tokens=400, background=True, **GREEDY)
    deadline = time.time() + 60
    while metric(http.get("/metrics").text, "pagedllm:num_requests_running") == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    wait_idle(http)
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"   # twice is harmless
    done = http.post(f"/v1/responses/{bg.id}/cancel")
    assert done.status_code == 400 and "only a response still being generated" in done.json()["error"]["message"]


def test_background_response_streams_from_any_point(client, http):
    """A background response's events are kept: retrieve(stream=True) replays them (after
    starting_after) and follows the rest live; create(background, stream) streams too, and the
    response runs on when that client goes away."""
    kw = dict(model=MODEL, input="count", max_output_tokens=300, background=True, **GREEDY)
    bg = client.responses.create(**kw)
    live = list(client.responses.retrieve(bg.id, stream=True))  # joins while it runs (300 tokens)
    assert [e.sequence_number for e in live] == list(range(len(live)))
    assert [e.type for e in live[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert live[0].response.status == "queued" and live[-1].type == "response.incomplete"
    final = client.responses.retrieve(bg.id)
    assert "".join(e.delta for e in live if e.type == "response.output_text.delta") == final.output_text
    assert live[-1].response.output_text == final.output_text and final.usage.output_tokens == 300
    tail = list(client.responses.retrieve(bg.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in tail] == list(range(4, len(live)))
    err = http.get(f"/v1/responses/{bg.id}", params={"stream": "true", "starting_after": -1})
    assert err.status_code == 400 and err.json()["error"]["param"] == "starting_after"
    streamed = list(client.responses.create(stream=True, **kw))
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.background
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == final.output_text
    # a client that leaves a background stream early does not stop the response
    with client.responses.create(stream=True, **{**kw, "max_output_tokens": 200}) as stream:
        first = next(iter(stream))
    rid = first.response.id
    deadline = time.time() + 60
    while (got := client.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.1)
    assert got.status == "incomplete" and got.usage.output_tokens == 200
    wait_idle(http)


def test_cancel_a_streaming_response(client, http, server):
    stream = client.responses.create(model=MODEL, input="stream me", max_output_tokens=400, stream=True, **GREEDY)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) == 6:
            rid = seen[0].response.id
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as other:
                assert other.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
    assert seen[-1].response.status == "cancelled"
    assert seen[-1].response.usage is None
    wait_idle(http)


def test_disconnect_aborts_and_frees_blocks(client, http):
    aborted = metric(wait_idle(http), "pagedllm:request_success_total", finished_reason="abort")
    stream = client.responses.create(model=MODEL, input="disconnect", max_output_tokens=400, stream=True, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    text = wait_idle(http)
    assert metric(text, "pagedllm:request_success_total", finished_reason="abort") == aborted + 1


def test_bad_requests_get_openai_errors(server, http):
    def post(body):
        return http.post("/v1/responses", json={"model": MODEL, **body})

    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]})
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
    for body, param in [({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
                        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "hi", "temperature": -1}, "temperature"),
                        ({"input": "hi", "background": True, "store": False}, "background"),
                        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
                        ({"input": "hi", "truncation": "auto"}, "truncation"),
                        ({"input": "hi " * 600}, "input"),
                        ({"input": []}, "input")]:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    r = post({"input": "hi", "model": "other"})
    assert r.status_code == 404
    assert http.post("/v1/responses/resp_nope/cancel").status_code == 404
    # an output for a call nobody made; an item type this server does not take; nulls mean defaults
    r = post({"input": [{"role": "user", "content": "hi"},
                        {"type": "function_call_output", "call_id": "call_x", "output": "sunny"}]})
    assert r.status_code == 400 and "No tool call found for function call output with call_id 'call_x'" in \
        r.json()["error"]["message"]
    r = post({"input": [{"type": "bogus_item", "x": 1}]})
    assert r.status_code == 400 and "input item 0 has type 'bogus_item'" in r.json()["error"]["message"]
    # the param names the item's field where the item has one (as chat's messages.N.content.J does)
    for item, message, param in (({"role": "tool", "content": "x"}, "input item 1 (message): role: Input should be",
                                  "input.1.role"),
                                 ({"type": "function_call_output", "output": "x"},
                                  "input item 1 (function_call_output): call_id: Field required", "input.1.call_id"),
                                 ("hi", "input item 1 must be an object", "input.1")):
        err = post({"input": [{"role": "user", "content": "hi"}, item]}).json()["error"]
        assert err["message"].startswith(message) and err["param"] == param, err
    r = post({"input": "hi", "max_output_tokens": 2, "store": None, "background": None, "stream": None,
              "parallel_tool_calls": None, "tool_choice": None})
    assert r.status_code == 200 and r.json()["store"] is True and r.json()["tool_choice"] == "auto"
    for reasoning in ({}, {"effort": None, "summary": None}):  # nothing asked: not a refusal
        assert post({"input": "hi", "max_output_tokens": 2, "reasoning": reasoning}).status_code == 200


@pytest.mark.parametrize("extra,param", [
    (b'"user": "\\ud800"', "user"),
    (b'"metadata": {"k": "\\ud800"}, "stream": true', "metadata.k"),
    (b'"metadata": {"k": "\\ud800"}, "background": true', "metadata.k"),
    (b'"tools": [{"type": "function", "name": "f", "description": "\\udc00", "parameters": {}}]',
     "tools.0.description"),
    (b'"text": {"format": {"type": "json_schema", "name": "\\ud800", "schema": {"type": "object"}}}',
     "text.format.name"),
])
def test_lone_surrogates_are_refused_up_front(http, extra, param):
    """A field echoed back in the response object that held a lone surrogate made the response
    unserializable: a 500, or a 200 stream that never ended. Now a 400 naming the field."""
    body = b'{"model": "' + MODEL.encode() + b'", "input": "a", "max_output_tokens": 2, ' + extra + b"}"
    r = http.post("/v1/responses", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"], err
    assert http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2}).status_code == 200


def test_a_bad_text_format_schema_names_text_format(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "zzz"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_input_items_lists_the_request_input(client, http):
    items = [{"role": "developer", "content": "be terse"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what is the weather"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": "fco_mine"}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=2, **GREEDY)
    page = client.responses.input_items.list(r.id)  # newest first, as OpenAI's default order
    assert [i.type for i in page.data] == ["function_call_output", "function_call", "message", "message"]
    assert page.data[0].id == "fco_mine" and page.data[0].output == "sunny" and page.data[1].call_id == "call_1"
    assert [(m.role, m.content[0].text) for m in page.data[2:]] == [("user", "what is the weather"),
                                                                    ("developer", "be terse")]
    body = http.get(f"/v1/responses/{r.id}/input_items", params={"order": "asc", "limit": 2}).json()
    assert body["object"] == "list" and body["has_more"] is True and len(body["data"]) == 2
    assert body["first_id"] == body["data"][0]["id"] and body["data"][0]["content"][0]["text"] == "be terse"
    rest = http.get(f"/v1/responses/{r.id}/input_items",
                    params={"order": "asc", "after": body["last_id"]}).json()
    assert [i["type"] for i in rest["data"]] == ["function_call", "function_call_output"] and not rest["has_more"]
    plain = client.responses.create(model=MODEL, input="hello there", max_output_tokens=2, **GREEDY)
    assert [(i.role, i.content[0].text) for i in client.responses.input_items.list(plain.id).data] == [
        ("user", "hello there")]
    for params, param in (({"limit": 0}, "limit"), ({"limit": "abc"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "nope"}, "after")):
        err = http.get(f"/v1/responses/{r.id}/input_items", params=params)
        assert err.status_code == 400 and err.json()["error"]["param"] == param
    assert http.get("/v1/responses/resp_nope/input_items").status_code == 404
    err = http.get(f"/v1/responses/{r.id}", params={"stream": "true"})
    assert err.status_code == 400 and err.json()["error"]["param"] == "stream"


def test_response_store_bounds_count_and_age(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    store = ResponseStore(max_count=2, ttl_s=10)
    for i in range(3):
        store.put(StoredResponse(response=ResponseObject(id=f"r{i}", model="m")))
        clock[0] += 4
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    clock[0] += 4   # r1 is now 12 s old, r2 8 s
    assert store.get("r1") is None and store.get("r2") is not None
    with pytest.raises(ValueError):
        ResponseStore(max_count=0)


def test_response_store_bounds_bytes():
    """Input items the template never renders (a reasoning item's encrypted_content) are held too:
    the store evicts its oldest entries once their JSON passes max_bytes, keeps the newest even
    when it alone is larger, and its count follows puts, growth at the end and deletes."""
    store = ResponseStore(max_count=100, ttl_s=100, max_bytes=12_000)
    blob = [{"type": "reasoning", "summary": [], "encrypted_content": "x" * 3000}]
    entries = []
    for i in range(5):
        entries.append(StoredResponse(response=ResponseObject(id=f"r{i}", model="m"), input_items=blob))
        store.put(entries[-1])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.nbytes == sum(e.nbytes for e in entries[2:]) and 9000 < store.nbytes <= 12_000
    entries[4].messages = [{"role": "assistant", "content": "y" * 2000}]  # its output, at the end
    store.measure(entries[4])
    assert store.get("r2") is None and store.get("r3") is not None and store.nbytes <= 12_000
    huge = StoredResponse(response=ResponseObject(id="big", model="m"), input_items=blob * 10)
    store.put(huge)
    assert len(store) == 1 and store.get("big") is huge and store.nbytes == huge.nbytes
    assert store.delete("big") and store.nbytes == 0
    # what the response object holds counts too (a text.format schema's 3 MB description, say)
    fat = ResponseObject(id="fat", model="m", instructions="z" * 20_000)
    store.put(StoredResponse(response=fat))
    store.put(StoredResponse(response=ResponseObject(id="thin", model="m")))
    assert store.get("fat") is None and store.get("thin") is not None
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=0)


WEATHER = {"type": "function", "name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="pick a colour", max_output_tokens=40, temperature=0.0,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert r.status == "completed", r
    assert r.created_at <= r.completed_at <= time.time() + 1  # set once completed (null while incomplete)
    assert json.loads(r.output_text)["color"] in ("red", "blue")
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(model=MODEL, input="any object", max_output_tokens=60, temperature=0.0,
                                  text={"format": {"type": "json_object"}})
    if obj.status == "completed":   # a random model may run out of tokens inside the object
        assert isinstance(json.loads(obj.output_text), dict)
    else:
        assert obj.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_tool_choice_returns_function_calls(client, choice):
    r = client.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                max_output_tokens=60, temperature=0.0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed", r
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("chatcmpl-tool")
        assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # streamed: the arguments events carry the same call
    events = list(client.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER],
                                          tool_choice=choice, max_output_tokens=60, temperature=0.0, stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [json.loads(c.arguments) for c in calls]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the SDK's helper assembles it (response.completed is sent)
    with client.responses.stream(model=MODEL, input="weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                 max_output_tokens=60, temperature=0.0) as stream:
        final = stream.get_final_response()
    assert [o.arguments for o in final.output if o.type == "function_call"] == [c.arguments for c in calls]


def test_tool_result_continues_through_previous_response_id(client, tokenizer):
    first = client.responses.create(model=MODEL, input="weather in Rome?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=60, temperature=0.0)
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}], max_output_tokens=5, **GREEDY)
    history = [{"role": "user", "content": "weather in Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    assert second.usage.input_tokens == n_template_tokens(tokenizer, history)   # tool_choice none: no tools


def test_auto_tool_choice_needs_the_server_flag(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [WEATHER]})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [WEATHER],
                                         "tool_choice": {"type": "function", "name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                         "text": {"format": {"type": "json_schema", "name": "x",
                                                             "schema": {"type": "object", "minProperties": "x"}}}})
    assert r.status_code == 400
