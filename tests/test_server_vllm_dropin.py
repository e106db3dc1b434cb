"""A drop-in for vLLM deployments (issue 43), through a real ``pagedllm serve`` (tiny random Llama,
byte-level BPE) driven by the ``openai`` client and raw httpx: tool calls stream one entry per index
per chunk; OpenAI's response shape (no ``tool_calls`` key without a call, ``system_fingerprint``,
``usage.prompt_tokens_details.cached_tokens`` with --enable-prompt-tokens-details); and vLLM's ops
routes (/ping, /invocations, /load, /tokenizer_info) with and without their flags."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

from server_utils import RemoteServer
from pagedllm.entrypoints.openai.ops_routes import LoadCounter, ServerLoad
from pagedllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from pagedllm.entrypoints.openai.tool_parsers.tool_call_output import one_entry_per_index
from pagedllm.models.checkpoint import load_tokenizer

MODEL = "tiny"
BLOCK = 16  # --block-size's default: prefix-cache hits come in whole blocks
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MSGS = [{"role": "user", "content": "the king said"}]
FINGERPRINT = re.compile(r"fp_[0-9a-f]{10}")


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dropin")
    (tmp / "t.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--chat-template", str(tmp / "t.jinja"), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--enable-prompt-tokens-details", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint")
    with RemoteServer(llama_dir, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def plain(tiny_server):
    """A server without the flags (conftest's session server): their features stay off, as in vLLM."""
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        yield c


def sse_chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response, up to ``[DONE]`` (which must come)."""
    chunks = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"no [DONE] after {chunks[-3:]}")


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 40, "temperature": 1.0, "seed": 3, **kw}


# ---- Found 4: one entry per tool-call index per chunk ---------------------------------------------
def test_one_entry_per_index_merges_fragments():
    first = DeltaToolCall(index=0, id="call-a", type="function", function=DeltaFunctionCall(name="f", arguments=""))
    got = one_entry_per_index([first, DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"'),),
                               DeltaToolCall(index=1, id="call-b", type="function",
                                             function=DeltaFunctionCall(name="g", arguments="{}")),
                               DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='a":1}'))])
    assert [c.model_dump() for c in got] == [
        {"index": 0, "id": "call-a", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
        {"index": 1, "id": "call-b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    assert first.function.arguments == ""  # the input entries are left as they were


def test_named_tool_choice_streams_one_entry_per_index(http):
    body = chat_body(max_tokens=200, seed=7, tools=TOOLS, tool_choice=NAMED)
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    [call] = whole["message"]["tool_calls"]
    chunks = sse_chunks(http, "/v1/chat/completions", {**body, "stream": True})
    entries = []
    for ch in chunks:
        for choice in ch["choices"]:
            calls = choice["delta"].get("tool_calls", [])
            assert len({c["index"] for c in calls}) == len(calls), ch  # never two entries of one index
            entries += calls
    assert all(e["index"] == 0 for e in entries) and len(entries) > 2
    head = entries[0]
    assert head["id"].startswith("chatcmpl-tool-") and head["type"] == "function"
    assert head["function"]["name"] == "get_weather" and isinstance(head["function"]["arguments"], str)
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in entries[1:])
    streamed = "".join(e["function"]["arguments"] for e in entries)
    assert json.loads(streamed) == json.loads(call["function"]["arguments"])  # same seed, same call
    assert json.loads(streamed)["city"] in ("Paris", "Rome")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- Found 8: OpenAI's response shape -----------------------------------------------------------------
def test_no_tool_calls_key_when_no_tool_was_called(http):
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}):  # no tools / auto / none
        r = http.post("/v1/chat/completions", json=chat_body(**extra)).json()
        message = r["choices"][0]["message"]
        assert "tool_calls" not in message and message["role"] == "assistant", r
        assert isinstance(message["content"], str) and message["content"]
        chunks = sse_chunks(http, "/v1/chat/completions", chat_body(stream=True, **extra))
        deltas = [c["delta"] for ch in chunks for c in ch["choices"]]
        assert deltas and not any("tool_calls" in d for d in deltas), deltas
        assert "".join(d.get("content", "") for d in deltas) == message["content"]  # same seed
    called = http.post("/v1/chat/completions", json=chat_body(max_tokens=200, tools=TOOLS, tool_choice=NAMED))
    assert len(called.json()["choices"][0]["message"]["tool_calls"]) == 1  # a call still has the key


def test_system_fingerprint_on_chat_and_completions(http, client):
    seen = set()
    chat = http.post("/v1/chat/completions", json=chat_body()).json()
    seen.add(chat["system_fingerprint"])
    for ch in sse_chunks(http, "/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True})):
        seen.add(ch["system_fingerprint"])
    body = {"model": MODEL, "prompt": "the king", "max_tokens": 5}
    seen.add(http.post("/v1/completions", json=body).json()["system_fingerprint"])
    for ch in sse_chunks(http, "/v1/completions", {**body, "stream": True}):
        seen.add(ch["system_fingerprint"])
    seen.add(http.post("/v1/completions", json={**body, "echo": True, "max_tokens": 0}).json()["system_fingerprint"])
    [fp] = seen  # one server, one configuration: one fingerprint everywhere
    assert FINGERPRINT.fullmatch(fp), fp
    assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3).system_fingerprint == fp


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_cached_tokens_with_enable_prompt_tokens_details(http, client):
    # completions: the first time nothing is cached; the second time every whole block but the
    # one holding the last prompt token (its logits must be computed) comes from the cache
    body = {"model": MODEL, "prompt": _words("zebra", 30), "max_tokens": 4, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()["usage"]
    n = first["prompt_tokens"]
    assert n > 3 * BLOCK and first["prompt_tokens_details"] == {"cached_tokens": 0}, first
    again = http.post("/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": (n - 1) // BLOCK * BLOCK}, again
    final = sse_chunks(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert final[-1]["choices"] == [] and final[-1]["usage"] == again
    two = http.post("/v1/completions", json={**body, "prompt": [body["prompt"], _words("yak", 30)]}).json()["usage"]
    assert two["prompt_tokens_details"] == {"cached_tokens": (n - 1) // BLOCK * BLOCK}  # summed: 2nd is new

    # chat: the same rule over the rendered conversation; the openai client reads the field
    msgs = [{"role": "user", "content": _words("koala", 30)}]
    r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == (r2.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    stream = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens_details.cached_tokens


def test_flags_off_by_default(plain):
    """Without the flags: no prompt_tokens_details, /load stays 0 with a request in flight,
    /tokenizer_info is not served; system_fingerprint and the tool_calls rule need no flag."""
    body = {"model": MODEL, "prompt": _words("zebra", 30), "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        usage = plain.post("/v1/completions", json=body).json()["usage"]
        assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 3 * BLOCK, usage
    chat = plain.post("/v1/chat/completions", json=chat_body()).json()
    assert FINGERPRINT.fullmatch(chat["system_fingerprint"]) and "tool_calls" not in chat["choices"][0]["message"]
    with plain.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True,
                                                       "stream": True}) as r:
        next(r.iter_lines())  # the request is running
        assert plain.get("/load").json() == {"server_load": 0}
    assert plain.get("/tokenizer_info").status_code == 404


# ---- Found 3: vLLM's ops routes ------------------------------------------------------------------------
def test_ping_answers_as_health(http):
    for method in ("GET", "POST"):
        r = http.request(method, "/ping")
        assert r.status_code == 200 and r.content == b"", (method, r.text)
    assert http.get("/health").status_code == 200


def test_invocations_routes_by_body(http):
    chat = http.post("/invocations", json=chat_body()).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["message"]["content"] == http.post(
        "/v1/chat/completions", json=chat_body()).json()["choices"][0]["message"]["content"]  # same seed
    done = http.post("/invocations", json={"model": MODEL, "prompt": "the king", "max_tokens": 3}).json()
    assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] == 3
    chunks = sse_chunks(http, "/invocations", chat_body(stream=True))
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[-1]["choices"][0]["finish_reason"]
    # "input": embeddings, which this (generating) server refuses as /v1/embeddings does
    emb = http.post("/invocations", json={"model": MODEL, "input": "the king"})
    assert emb.status_code == 400 and emb.json() == http.post("/v1/embeddings", json={"input": "the king"}).json()
    assert "--runner pooling" in emb.json()["error"]["message"]
    # a malformed body gets the 400 of the API it is for
    bad = http.post("/invocations", json=chat_body(n=0))
    assert bad.status_code == 400 and bad.json() == http.post("/v1/chat/completions", json=chat_body(n=0)).json()
    wrong = http.post("/invocations", json={"model": MODEL, "prompt": "x", "max_tokens": "many"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "max_tokens", wrong.text
    for body, words in (({"model": MODEL}, "give messages (chat completions), prompt (completions) or input"),
                        ([1, 2], "must be a JSON object")):
        r = http.post("/invocations", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = http.post("/invocations", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Invalid JSON body"), r.text


def test_server_load_middleware_counts_until_the_response_ends():
    """ServerLoad with a stand-in app that holds its responses: the count is the inference requests
    whose app call has not returned; other paths, and a disabled counter, count nothing."""
    gate = asyncio.Event()

    async def app(scope, receive, send):
        await gate.wait()

    async def main():
        on, off = LoadCounter(True), LoadCounter(False)
        counted, not_counted = ServerLoad(app, on), ServerLoad(app, off)
        calls = [asyncio.ensure_future(mw({"type": "http", "path": path}, None, None))
                 for mw, path in ((counted, "/v1/chat/completions"), (counted, "/v1/completions"),
                                  (counted, "/invocations"), (counted, "/v1/responses/resp-1"), (counted, "/health"),
                                  (counted, "/v1/models"), (not_counted, "/v1/completions"))]
        await asyncio.sleep(0)
        during = (on.count, off.count)
        gate.set()
        await asyncio.gather(*calls)
        return during, (on.count, off.count)

    assert asyncio.run(main()) == ((4, 0), (0, 0))


def test_load_counts_requests_in_flight(http, server):
    assert http.get("/load").json() == {"server_load": 0}
    body = {"model": MODEL, "prompt": "the king", "max_tokens": 240, "n": 4, "ignore_eos": True}
    chat = {"model": MODEL, "messages": MSGS, "max_tokens": 240, "n": 4, "ignore_eos": True}
    statuses, seen = [], set()

    def run(path: str, payload: dict) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            statuses.append(c.post(path, json=payload).status_code)

    # two requests at once, one streamed: /load sees both while they run, then none
    runs = [threading.Thread(target=run, args=("/v1/completions", {**body, "stream": True})),
            threading.Thread(target=run, args=("/v1/chat/completions", chat))]
    for t in runs:
        t.start()
    while any(t.is_alive() for t in runs):
        seen.add(http.get("/load").json()["server_load"])
    assert statuses == [200, 200] and 2 in seen and seen <= {0, 1, 2}, (statuses, seen)
    assert http.get("/load").json() == {"server_load": 0}
    # a stream the client leaves stops counting once the server sees the disconnect
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            next(r.iter_lines())
    deadline = time.time() + 30
    while http.get("/load").json()["server_load"] and time.time() < deadline:
        time.sleep(0.05)
    assert http.get("/load").json() == {"server_load": 0}


def test_tokenizer_info(http, llama_dir):
    """vLLM's shape: tokenizer_config's settings, the loaded class's name, --chat-template's text."""
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(load_tokenizer(llama_dir)).__name__  # (transformers 5: TokenizersBackend)
    assert info["chat_template"] == TEMPLATE  # the server's, over the tokenizer's own
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["pad_token"] == "<pad>", info
    assert info["added_tokens_decoder"]["3"] == "<|user|>"  # AddedToken objects as their text
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)  # no paths of the server's files


@pytest.fixture(scope="module")
def pooling(qwen3_dir, tmp_path_factory):
    """An embedding server (--runner pooling)."""
    tmp = tmp_path_factory.mktemp("dropin-pooling")
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "2MiB", "--runner", "pooling")
    with RemoteServer(qwen3_dir, args, log_path=str(tmp / "server.log")) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c
    assert srv.returncode == 0, srv.log()


def test_invocations_on_an_embedding_server(pooling):
    """input and messages (vLLM's chat form of /v1/embeddings) go to embeddings; prompt to completions,
    which this server refuses as /v1/completions does."""
    for body in ({"model": MODEL, "input": ["the king", "the queen"]}, {"model": MODEL, "messages": MSGS}):
        got, want = pooling.post("/invocations", json=body), pooling.post("/v1/embeddings", json=body)
        assert got.status_code == 200 and got.json()["object"] == "list", got.text
        assert [d["embedding"] for d in got.json()["data"]] == [d["embedding"] for d in want.json()["data"]]
        assert len(got.json()["data"]) == (2 if "input" in body else 1)
    r = pooling.post("/invocations", json={"model": MODEL, "prompt": "the king"})
    assert r.status_code == 400 and r.json() == pooling.post("/v1/completions", json={"prompt": "the king"}).json()
    assert "/v1/embeddings" in r.json()["error"]["message"]
