"""Issue 13, black-box against a real ``pagedllm serve``: CORS with an API key, chat/completion
edges, documented fields applied or refused (never silently dropped), limits that hold
(max_num_seqs with n > 1, stop_token_ids, slow and surplus connections), a clean end for streams
aborted at shutdown, and the small CLI things (bench without httpx, plain bench help)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_utils import RemoteServer, metric

MODEL = "tiny"
KEY = "edge-key"
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS = 6
LIMIT = 24          # --limit-concurrency
READ_TIMEOUT = 2    # --timeout-request-read, seconds
MAX_LOGPROBS = 3    # --max-logprobs
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("edges") / "server.log")
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--disable-access-log", "--api-key", KEY,
            "--allowed-origins", ORIGIN, "--limit-concurrency", str(LIMIT),
            "--timeout-request-read", str(READ_TIMEOUT), "--max-logprobs", str(MAX_LOGPROBS))
    with RemoteServer(llama_dir, args, log_path=log) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()




def chat_body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "the king"}], "max_tokens": 2, **kw}


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


# ---- 4. browser clients: CORS ------------------------------------------------------------------
def test_cors_preflight_needs_no_key_and_everything_else_does(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.options("/v1/chat/completions", headers=preflight)  # no API key
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        # an origin not in --allowed-origins gets no permission
        r = h.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        # the actual request still needs the key; the 401 is readable by the page (CORS header)
        r = h.post("/v1/chat/completions", json=chat_body(), headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        # a plain OPTIONS (not a preflight) is not a way around the key
        assert h.options("/v1/models").status_code == 401
        r = h.post("/v1/chat/completions", json=chat_body(), headers={"Origin": ORIGIN, **AUTH})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert r.json()["usage"]["completion_tokens"] == 2


def test_invocations_needs_the_key_and_ops_routes_do_not(server):
    """SageMaker's /invocations runs the model, so an API key guards it as it guards /v1/*;
    /ping and /load (health and load probes) answer without one."""
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/invocations", json=chat_body())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = h.post("/invocations", json=chat_body(), headers=AUTH)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
        assert h.get("/ping").status_code == 200 and h.get("/load").json() == {"server_load": 0}


# ---- 5. chat and completion edges --------------------------------------------------------------
def test_continue_final_message_with_add_generation_prompt_is_refused(http):
    messages = [{"role": "user", "content": "speak"}, {"role": "assistant", "content": "the king"}]
    err = error_of(http.post("/v1/chat/completions", json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": True}))
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]
    err = error_of(http.post("/v1/chat/completions", json={
        "messages": messages, "chat_template_kwargs": {"continue_final_message": True,
                                                       "add_generation_prompt": True}}))
    assert err["param"] == "continue_final_message"
    # alone (add_generation_prompt left at its default) it continues the final message
    r = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True,
                                                "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_text_parts_behave_like_the_same_string(client):
    as_string = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me of the king"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": [{"type": "text", "text": "tell me of "},
                                             {"type": "text", "text": "the king"}]}]
    outs = [client.chat.completions.create(model=MODEL, messages=m, max_tokens=12, logprobs=True, **GREEDY)
            for m in (as_string, as_parts)]
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    assert outs[0].usage.prompt_tokens == outs[1].usage.prompt_tokens
    lp = [[t.logprob for t in o.choices[0].logprobs.content] for o in outs]
    assert lp[0] == pytest.approx(lp[1], abs=1e-5)


def test_image_part_on_a_text_only_model(http):
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    err = error_of(http.post("/v1/chat/completions", json=body))
    assert err["message"] == ("This model accepts only text, so a message content part of type 'image_url' "
                              "cannot be used.")
    assert err["param"].startswith("messages.0.content")


def test_echo_with_max_tokens_0_scores_the_prompt(client, http):
    prompt = "the king and the queen"
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 0)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the same numbers as echo with generation (prompt part), and as a stream
    gen = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=1, logprobs=2, **GREEDY)
    assert gen.choices[0].logprobs.token_logprobs[1:n_prompt] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    chunks = list(client.completions.create(model=MODEL, prompt=[prompt, "of the"], echo=True, max_tokens=0,
                                            stream=True))
    assert sorted((c.choices[0].index, c.choices[0].text) for c in chunks) == [(0, prompt), (1, "of the")]
    # without echo, max_tokens 0 is still refused
    assert error_of(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}))["param"] == "max_tokens"


def test_min_tokens_holds_back_stop_strings(client):
    prompt = "the king"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, **GREEDY)
    stop = free.choices[0].text[1:3]  # inside the first tokens: ends the request at once
    assert stop.strip()
    early = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stop=[stop], **GREEDY)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens <= 3
    held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stop=[stop], temperature=0.0,
                                     extra_body={"ignore_eos": True, "min_tokens": 6})
    assert held.usage.completion_tokens >= 6


# ---- nothing accepted and silently ignored -------------------------------------------------
REFUSED_COMMON = [("best_of", 3), ("use_beam_search", True), ("length_penalty", 0.5), ("priority", 1),
                  ("priority", True), ("priority", "2"),
                  ("logits_processors", ["x"]), ("return_tokens_as_token_ids", True),
                  ("return_token_ids", True), ("cache_salt", "s"), ("kv_transfer_params", {}),
                  ("vllm_xargs", {"a": 1}), ("store", True), ("service_tier", "flex"),
                  ("spaces_between_special_tokens", False)]
REFUSED_CHAT = [("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x"}),
                ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
                ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}), ("echo", True),
                ("chat_template", "{{ x }}"), ("mm_processor_kwargs", {}), ("add_special_tokens", True)]


@pytest.mark.parametrize("field,value", REFUSED_COMMON + REFUSED_CHAT)
def test_documented_field_refused_on_chat(http, field, value):
    err = error_of(http.post("/v1/chat/completions", json=chat_body(**{field: value})))
    assert err["param"] == field, err


@pytest.mark.parametrize("field,value", REFUSED_COMMON + [("suffix", "!"), ("best_of", 1),
                                                          ("prompt_embeds", "AAAA"), ("stream_options", {})])
def test_documented_field_refused_on_completions(http, field, value):
    body = {"prompt": "the king", "max_tokens": 2, "n": 2, field: value}
    assert error_of(http.post("/v1/completions", json=body))["param"] == field


def test_documented_fields_applied_or_harmless(client, http):
    base = {"prompt": "the king and", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    ref = http.post("/v1/completions", json=base).json()
    # metadata fields that ask nothing of the server; best_of == n is plain sampling
    same = http.post("/v1/completions", json={**base, "user": "u1", "metadata": {"a": "b"}, "service_tier": "auto",
                                              "prompt_cache_key": "k", "safety_identifier": "s", "best_of": 1,
                                              "store": False}).json()
    assert same["choices"][0]["text"] == ref["choices"][0]["text"]
    # truncate_prompt_tokens keeps the last k prompt tokens
    ids = http.post("/tokenize", json={"prompt": "the king and the queen of the"}).json()["tokens"]
    t = http.post("/v1/completions", json={**base, "prompt": "the king and the queen of the",
                                           "truncate_prompt_tokens": 3}).json()
    tail = http.post("/v1/completions", json={**base, "prompt": ids[-3:]}).json()
    assert t["usage"]["prompt_tokens"] == 3 and t["choices"][0]["text"] == tail["choices"][0]["text"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the king"}], max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    # vLLM's request_id names the response (the engine keeps a unique id of its own)
    for _ in range(2):
        assert http.post("/v1/completions", json={**base, "request_id": "abc"}).json()["id"] == "cmpl-abc"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the"}], max_tokens=1,
                                       extra_body={"request_id": "xyz", "include_reasoning": True})
    assert r.id == "chatcmpl-xyz"


def test_explicit_nulls_mean_the_defaults(http):
    """Clients that send every field send null for the unset ones (the OpenAI reference types them
    nullable): each gives the same answer as leaving the field out."""
    base = {"prompt": "the king", "max_tokens": 3, "temperature": 0.0}
    ref = http.post("/v1/completions", json=base).json()
    nulls = http.post("/v1/completions", json={**base, "n": None, "stream": None, "echo": None, "logprobs": None,
                                               "ignore_eos": None, "min_tokens": None, "best_of": None})
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "the king"}], "max_tokens": 3, "temperature": 0.0}
    ref = http.post("/v1/chat/completions", json=chat).json()
    nulls = http.post("/v1/chat/completions", json={**chat, "n": None, "stream": None, "logprobs": None,
                                                    "parallel_tool_calls": None, "echo": None})
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"] == ref["choices"][0]["message"]
    assert error_of(http.post("/v1/chat/completions", json={**chat, "messages": None}))["param"] == "messages"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(http, route):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far,
    and the last chunk the whole request's."""
    body = ({"prompt": "the king"} if route == "/v1/completions" else
            {"messages": [{"role": "user", "content": "the king"}]})
    body.update(max_tokens=5, temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    with http.stream("POST", route, json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5  # (a chunk may carry several tokens)
    assert all(c["usage"]["prompt_tokens"] == prompt and
               c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", route, json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_tokenize_token_strs_and_the_developer_role(http, llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    r = http.post("/tokenize", json={"prompt": "the king and", "return_token_strs": True}).json()
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and len(r["token_strs"]) == r["count"]
    assert "token_strs" not in http.post("/tokenize", json={"prompt": "the king and"}).json()
    # A template that never names "developer" gets it as the system message (OpenAI's meaning).
    as_dev = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "be brief"},
                                                       {"role": "user", "content": "hi"}]}).json()
    as_sys = http.post("/tokenize", json={"messages": [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hi"}]}).json()
    assert "developer" not in (tok.chat_template or "") and as_dev["tokens"] == as_sys["tokens"]


def test_unknown_fields_are_accepted_and_logged_once(server, http):
    for _ in range(3):
        r = http.post("/v1/completions", json={"prompt": "the", "max_tokens": 1, "frobnicate_level": 7})
        assert r.status_code == 200, r.text
    deadline = time.time() + 10
    while "frobnicate_level" not in server.log() and time.time() < deadline:
        time.sleep(0.2)
    assert server.log().count("'frobnicate_level'") == 1


# ---- 6. limits that hold -----------------------------------------------------------------------
def test_stop_token_ids_outside_vocabulary(http):
    for bad in ([10 ** 6], [-1]):
        for route, body in (("/v1/completions", {"prompt": "the", "max_tokens": 2}), ("/v1/chat/completions",
                                                                                     chat_body())):
            err = error_of(http.post(route, json={**body, "stop_token_ids": bad}))
            assert err["param"] == "stop_token_ids"


def test_n_more_than_max_num_seqs(http):
    err = error_of(http.post("/v1/completions", json={"prompt": "the", "max_tokens": 2, "n": MAX_NUM_SEQS + 1}))
    assert err["param"] == "n" and "--max-num-seqs" in err["message"]


def test_logprobs_above_max_logprobs(http):
    """--max-logprobs below the API's own cap of 20: more is a 400 naming the flag; at it, served."""
    for route, body, field in (("/v1/completions", {"prompt": "the", "max_tokens": 2}, "logprobs"),
                               ("/v1/chat/completions", chat_body(logprobs=True), "top_logprobs")):
        err = error_of(http.post(route, json={**body, field: MAX_LOGPROBS + 1}))
        assert err["param"] == field and f"(--max-logprobs {MAX_LOGPROBS})" in err["message"], err
        assert http.post(route, json={**body, field: MAX_LOGPROBS}).status_code == 200
        assert error_of(http.post(route, json={**body, field: -1}))["message"] == f"{field} must be >= 0, got -1"


def test_prompt_logprobs_on_chat_and_completions(http):
    """vLLM's prompt_logprobs: per prompt token None (the first) or token id -> {logprob, rank,
    decoded_token}, the token itself among them; on completions per choice (the same numbers as
    echo with logprobs), on chat beside the choices; refused when streamed, above --max-logprobs,
    or beside echo's logprobs of another size."""
    prompt = "the king said to the queen"
    body = {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, **{"temperature": 0.0}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    echo = http.post("/v1/completions", json={**body, "prompt_logprobs": None, "echo": True, "logprobs": 2,
                                              "max_tokens": 0}).json()["choices"][0]
    assert choice["logprobs"] is None and echo.get("prompt_logprobs") is None
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert len(plp) == n_prompt == len(echo["logprobs"]["token_logprobs"]) and plp[0] is None
    for j in range(1, n_prompt):
        entries = plp[j]
        assert 2 <= len(entries) <= 3 and all(e["logprob"] <= 0 and e["rank"] >= 1 for e in entries.values())
        own = [e for e in entries.values() if e["decoded_token"] == echo["logprobs"]["tokens"][j]]
        assert own and own[0]["logprob"] == pytest.approx(echo["logprobs"]["token_logprobs"][j], abs=1e-5)
    scored = http.post("/v1/completions", json={**body, "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert scored["logprobs"] is None and scored["prompt_logprobs"] == plp  # prompt scoring, no generation
    chat = http.post("/v1/chat/completions", json=chat_body(prompt_logprobs=1)).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(1 <= len(e) <= 2 for e in chat["prompt_logprobs"][1:])
    assert http.post("/v1/chat/completions", json=chat_body()).json().get("prompt_logprobs") is None
    for bad in ({"stream": True}, {"prompt_logprobs": MAX_LOGPROBS + 1}, {"echo": True, "logprobs": 1},
                {"prompt_logprobs": -1}):
        assert error_of(http.post("/v1/completions", json={**body, **bad}))["param"] == "prompt_logprobs", bad
    assert error_of(http.post("/v1/chat/completions", json=chat_body(prompt_logprobs=1, stream=True)))["param"] \
        == "prompt_logprobs"


def test_max_num_seqs_holds_under_a_storm_of_n3(server, http):
    body = {"prompt": "the king and the queen of the " * 6, "max_tokens": 24, "n": 3, "temperature": 1.0,
            "ignore_eos": True}
    seen: list[float] = []
    stop = threading.Event()

    def watch():
        with httpx.Client(base_url=server.url, timeout=30) as h:
            while not stop.is_set():
                seen.append(metric(h.get("/metrics").text, "pagedllm:num_requests_running"))
                time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            outs = list(pool.map(lambda i: http.post("/v1/completions", json={**body, "seed": i}), range(10)))
    finally:
        stop.set()
        watcher.join()
    assert all(r.status_code == 200 for r in outs)
    assert all(c["finish_reason"] == "length" for r in outs for c in r.json()["choices"])
    assert seen and max(seen) <= MAX_NUM_SEQS


def _half_sent(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n")
    return s


def _closed_by_server(s: socket.socket, timeout: float) -> bytes:
    """What the server sent before closing (b'' when it just closed); raises if it is still open."""
    s.settimeout(timeout)
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk


def test_slow_and_surplus_connections_are_dropped(server):
    socks = [_half_sent(server) for _ in range(LIMIT + 10)]  # slowloris: headers never finish
    try:
        # over --limit-concurrency: answered 503 at once and closed (a few may still be open: allow for them)
        refused = []
        for s in socks[LIMIT - 2:]:
            try:
                refused.append(_closed_by_server(s, 0.5))
            except socket.timeout:
                pass
        assert len(refused) >= 10 and all(b" 503 " in r and b"too_many_connections" in r for r in refused)
        # the held ones: closed once --timeout-request-read has passed, without any response
        t0 = time.time()
        for s in socks[:LIMIT - 2]:
            assert _closed_by_server(s, READ_TIMEOUT + 30) == b""
        assert time.time() - t0 < READ_TIMEOUT + 30
    finally:
        for s in socks:
            s.close()
    # and the server still answers
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    # a slow body is dropped too (headers complete, body never arrives)
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n{\"prompt\"")
    try:
        _closed_by_server(s, READ_TIMEOUT + 30)
    finally:
        s.close()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


# ---- 7. ending cleanly -------------------------------------------------------------------------
def _stream_events(url: str, route: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    started.set()


def test_shutdown_abort_ends_streams_cleanly(llama_dir, tmp_path):
    args = ("--served-model-name", MODEL, "--max-model-len", "1024", "--kv-cache-memory", "4MiB",
            "--shutdown-timeout", "0")
    common = {"max_tokens": 1000, "ignore_eos": True, "stream": True, "temperature": 0.0}
    streams = [("/v1/completions", {**common, "prompt": "the king"}),
               ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "the king"}]})]
    events: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]
    with RemoteServer(llama_dir, args, log_path=str(tmp_path / "server.log")) as srv:
        threads = [threading.Thread(target=_stream_events, args=(srv.url, route, body, ev, st))
                   for (route, body), ev, st in zip(streams, events, started)]
        for t in threads:
            t.start()
        assert all(st.wait(60) for st in started)
        srv.proc.send_signal(signal.SIGTERM)  # both still generating (1000 tokens each)
        for t in threads:
            t.join(60)
        srv.proc.wait(60)
    assert srv.returncode == 0, srv.log()
    for ev in events:  # a last chunk that says why, then [DONE]: not a cut stream
        assert ev[-1] == "[DONE]"
        assert json.loads(ev[-2])["choices"][0]["finish_reason"] == "abort"
        assert len(ev) < 1000
    log = srv.log()
    assert log.count("aborted 2 request(s) at shutdown") == 1 and "Traceback" not in log, log


# ---- 8. small things ---------------------------------------------------------------------------
def test_bench_serve_without_httpx_names_the_extra(monkeypatch, capsys):
    from pagedllm.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "httpx", None)  # as after the README's install
    assert main(["bench", "serve", "--model", "m", "--num-prompts", "1"]) == 1
    assert "pip install 'pagedllm[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["throughput", "serve", "memory", "profile", "prefix-caching"])
def test_bench_help_is_plain_text_with_defaults(command, capsys):
    from pagedllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and ":func:" not in out
    assert "(default: " in out or "default: " in out


def test_serve_errors_name_cli_flags(llama_dir):
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_dir, "--port", "0",
                        "--kv-cache-memory", "1KiB", "--max-model-len", "512", "--device", "cpu"],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("pagedllm serve: error:")
    assert "--kv-cache-memory" in err and "--max-model-len" in err
    assert "gpu-memory-utilization" not in err and "gpu_memory_utilization" not in err


def test_embeddings_need_the_pooling_runner(http):
    """A generating server answers /v1/embeddings with a 400 that says how to serve embeddings."""
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and "--runner pooling" in err["message"] and err["code"] == "model_not_supported"
