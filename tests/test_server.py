"""The OpenAI-compatible server, black-box: one real ``pagedllm serve`` subprocess (tiny random
Llama) for the whole module, driven with the official ``openai`` client (sync and async, stream
and not) and with ``httpx`` for the error paths."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from server_utils import metric, wait_idle

MODEL = "tiny"
MAX_MODEL_LEN = 256
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_server):
    """conftest's session server: MODEL, MAX_MODEL_LEN, a 4 MiB KV cache, --max-num-seqs 64,
    --disable-access-log, --max-request-bytes 1MiB (TINY_SERVER_ARGS)."""
    return tiny_server


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def n_tokens(http: httpx.Client, **body) -> int:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def stream_text(chunks) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of a single-choice completion stream."""
    text, finish, usage = "", None, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish, usage


# ---- basics ------------------------------------------------------------------------------------
def test_models_health_version(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    model = client.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert (model.id, model.object, model.max_model_len) == (MODEL, "model", MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no/such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert http.get("/health").status_code == 200
    r = http.head("/health")  # load balancers probe with HEAD
    assert (r.status_code, r.content) == (200, b"")
    assert http.get("/version").json()["version"]


def test_completion_usage_is_exact(client, http):
    prompt = "the king and the queen of"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason == "length"
    n_prompt = n_tokens(http, prompt=prompt)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 20, n_prompt + 20)
    # n > 1: completion tokens are summed over the choices, the prompt is counted once.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, n=3, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 21, n_prompt + 21)


def test_completion_stream_equals_non_stream(client):
    prompt = "romeo said to juliet"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text, finish, usage = stream_text(chunks)
    assert text == full.choices[0].text and len(text) > 0
    assert finish == full.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and usage == full.usage
    assert len(chunks) > 5  # tokens arrive as they are sampled, not in one piece


def test_chat_sync_async_stream_and_usage(server, client, http):
    messages = [{"role": "system", "content": "you are a poet"},
                {"role": "user", "content": [{"type": "text", "text": "tell me of the "}, {"type": "text",
                                                                                          "text": "king"}]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, **GREEDY)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    n_prompt = n_tokens(http, messages=messages)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 30)
    assert full.usage.total_tokens == n_prompt + 30

    async def run():
        async with async_client(server) as ac:
            nonstream = await ac.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,
                                                         **GREEDY)
            stream = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY)
            return nonstream, [c async for c in stream]

    nonstream, chunks = asyncio.run(run())
    assert nonstream.choices[0].message.content == choice.message.content
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_32_concurrent_streams_equal_each_request_alone(server):
    words = "the king queen lord romeo juliet thou thee thy great old world".split()
    prompts = [f"{words[i % 12]} {words[(i * 5) % 12]} {words[(i * 7 + 3) % 12]} and" for i in range(32)]
    kwargs = dict(model=MODEL, max_tokens=24, stream=True, **GREEDY)

    async def one(ac, prompt):
        text, finish = "", None
        async for ch in await ac.completions.create(prompt=prompt, **kwargs):
            for c in ch.choices:
                assert c.index == 0
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def run():
        async with async_client(server) as ac:
            alone = [await one(ac, p) for p in prompts]
            together = await asyncio.gather(*(one(ac, p) for p in prompts))
            return alone, together

    alone, together = asyncio.run(run())
    assert all(f == "length" and t for t, f in together)
    assert together == alone
    assert len(set(alone)) > 1


def test_n_choices_stream_interleaved(server):
    prompt = "thou art the"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})

    async def run():
        async with async_client(server) as ac:
            full = await ac.completions.create(**kwargs)
            chunks = [c async for c in await ac.completions.create(stream=True, **kwargs)]
            return full, chunks

    full, chunks = asyncio.run(run())
    order = [c.choices[0].index for c in chunks]
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)}
    assert set(order) == {0, 1, 2}
    assert order != sorted(order)  # interleaved as the choices advance together
    assert texts == {c.index: c.text for c in full.choices}
    assert len(set(texts.values())) > 1  # different seeds per choice


def test_echo_and_logprobs(client, http):
    prompt = "the old king"
    n_prompt = n_tokens(http, prompt=prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, logprobs=2, **GREEDY)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) == n_prompt + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    # greedy: the sampled token is the most likely one
    for i in range(n_prompt, n_prompt + 6):
        assert abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-5
    # streamed: same text and same tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, logprobs=2,
                                            stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert sum((ch.choices[0].logprobs.tokens for ch in chunks), []) == lp.tokens
    # without echo, logprobs cover only the completion
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=0, **GREEDY)
    assert len(r.choices[0].logprobs.tokens) == 6 and not r.choices[0].text.startswith(prompt)


def test_logprob_offsets_and_bytes_across_split_characters(client, llama_dir):
    """This byte-level BPE (trained on ASCII) splits an emoji or an accented letter into one token per
    byte: text_offset puts each token where its character starts (the character it completes or
    holds part of), never going back nor past the text, and each token's bytes are its own (U+FFFD's
    bytes, EF BF BD, before)."""
    from transformers import AutoTokenizer

    from pagedllm.engine.output_processor import OutputProcessor

    tok = AutoTokenizer.from_pretrained(llama_dir)
    prompt = "a \U0001F33E\u00e9\U0001F33E b"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert len(ids) > len(prompt)  # characters split over tokens
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=1, **GREEDY)
    c = r.choices[0]
    off = c.logprobs.text_offset
    want = [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert off[:len(ids)] == want, (off, want)
    assert off == sorted(off) and off[-1] <= len(c.text) and off[len(ids)] == len(prompt)
    proc = OutputProcessor(tok)
    assert b"".join(proc.token_bytes(t) for t in ids) == prompt.encode()
    assert proc.token_bytes(ids[0]) == b"a"


def test_text_offsets_skip_a_bos_token_and_stay_within_the_text():
    """The bundled demo model's tokenizer adds <s>, which an echoed prompt text does not hold: it adds
    no characters (each prompt offset was 3 too many before); and a last token held back from the
    text (a space and part of a character) points at most at the text's end."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pagedllm.engine.output_processor import OutputProcessor
    from pagedllm.entrypoints.openai.protocol import CompletionLogProbs
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedllm.config import DEMO_MODEL_PATH as DEMO_MODEL

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    proc = OutputProcessor(tok)
    serving = SimpleNamespace(token_text=proc.token_text, token_bytes=proc.token_bytes, tokenizer=tok)
    skipped = frozenset(tok.all_special_ids)
    prompt = "Hello there"
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id
    lp = CompletionLogProbs()
    end = OpenAIServingCompletion._add_logprobs(serving, lp, ids, None, 0, skipped=skipped, limit=len(prompt))
    assert lp.text_offset == [len(tok.decode(ids[1:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert lp.text_offset[-1] == prompt.index(" there") and end == len(prompt)
    # generated " f" then " " + the first byte of an emoji, held back from the text " f"
    held = tok.encode(" f\U0001F9E1", add_special_tokens=False)
    lp = CompletionLogProbs()
    OpenAIServingCompletion._add_logprobs(serving, lp, held, None, 0, skipped=skipped, limit=len(" f"))
    assert lp.text_offset == sorted(lp.text_offset) and max(lp.text_offset) <= len(" f")


def test_chat_continue_final_message(client, http):
    messages = [{"role": "user", "content": "speak"}, {"role": "assistant", "content": "the king"}]
    tok = http.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()
    rendered = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|assistant|>the king")
    for extra in ({"continue_final_message": True},
                  {"chat_template_kwargs": {"continue_final_message": True, "add_generation_prompt": False}}):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body=extra,
                                           temperature=0.0)
        assert r.usage.prompt_tokens == tok["count"]


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "the queen"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-5  # greedy picks the top token
        if "\ufffd" not in entry.token:  # a token holding part of a character has its own bytes
            assert entry.bytes == list(entry.token.encode())
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    assert r.choices[0].logprobs is None


def test_stop_string(client):
    prompt = "lord of the"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **GREEDY).choices[0].text
    stop = next(text[p:p + 3] for p in range(8, len(text) - 3)
                if text[p:p + 3].strip() and text.find(text[p:p + 3]) == p)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop=[stop, "\x00never"], **GREEDY)
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed, finish, _ = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                                stop=stop, stream=True, **GREEDY))
    assert (streamed, finish) == (r.choices[0].text, "stop")


def test_prompt_forms(client, http):
    prompts = ["the king", "juliet and romeo"]
    kw = dict(model=MODEL, max_tokens=6, **GREEDY)
    single = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert [by_index[0], by_index[1], by_index[2], by_index[3]] == [single[0], single[0], single[1], single[1]]
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and r.usage.completion_tokens == 24
    assert client.completions.create(prompt=ids[1], **kw).choices[0].text == single[1]
    r = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == single
    # a list of prompts streams with the right indexes too
    chunks = list(client.completions.create(prompt=prompts, stream=True, **kw))
    assert ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in (0, 1)] == single


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "the king of thee"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": "the king of thee"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "hi" in text
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400


# ---- bad input ---------------------------------------------------------------------------------
LONG_PROMPT = " ".join(["the king"] * 200)  # > 256 tokens
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"prompt": "a", ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"[" * 100000, 400, None),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', 400, "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages.0.content"),
    # a lone surrogate anywhere in the body (a 500, or a stream that never ended, before)
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "request_id": "\\ud800"}', 400, "request_id"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stream": true, '
                             b'"request_id": "x\\udfff"}', 400, "request_id"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "bad_words": ["ok", "\\ud800"]}', 400, "bad_words.1"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "metadata": {"\\ud800": "x"}}', 400, "metadata.\\ud800"),
    ("/tokenize", b'{"prompt": "a", "model": "\\ud800"}', 400, "model"),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', 400, "model"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": 5}, 400, "stream_options"),
    ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/completions", {"prompt": "a", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": -1}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "the king", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10 ** 6}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], [10 ** 12]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "seed": 2 ** 80}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "top_k": 2 ** 40}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "n": 10 ** 9}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 10 ** 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 9}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": [f"s{i}" for i in range(10000)]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": ["x"] * 257}, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 50,
                              "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "a"}]},
     400, "messages.0"),
    ("/v1/completions", {"prompt": ["a"] * 1025}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, 400, "n"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, None),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(http, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("content,ctype,expect", [
    (b'{"prompt": "a", "max_tokens": 1}', "application/x-www-form-urlencoded", "Content-Type: application/json"),
    (b'{"prompt": "a", "max_tokens": 1}', "text/plain", "(got 'text/plain')"),
    (b"", "application/json", "The request body is empty"),
    (b"[1, 2]", "application/json", "must be a JSON object"),
    (b'{"prompt": "\\ud800 hi"}', "application/json", "lone UTF-16 surrogate"),
])
def test_body_errors_say_what_is_wrong(http, content, ctype, expect):
    r = http.post("/v1/completions", content=content, headers={"Content-Type": ctype})
    assert r.status_code == 400, r.text
    assert expect in r.json()["error"]["message"], r.text


def test_chat_message_content_may_be_absent_only_for_assistant_and_tool_turns(http):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = http.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "user", "content": "b"}]})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "a user message needs content", r.text


def test_body_too_large(http):
    big = {"prompt": "x" * (1024 * 1024 + 10)}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-request-bytes" in r.json()["error"]["message"]  # (a big data: URL image hits it first)

    def chunked():  # no Content-Length: the limit applies to the bytes received
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'

    r = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_big_inputs_do_not_block_the_event_loop(server, http):
    """Tokenizing ~1 MB of text takes a while: /tokenize and chat content parts must do it off
    the event loop, so /health keeps answering meanwhile."""
    text = "the king of " * 85000
    bodies = [("/tokenize", {"prompt": text}), ("/tokenize", {"messages": [{"role": "user", "content": text}]}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})]
    for path, body in bodies:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, server.url + path, json=body, timeout=120)
            time.sleep(0.2)  # let the server read the body
            answered = 0
            while not fut.done():
                t0 = time.time()
                assert http.get("/health", timeout=120).status_code == 200
                answered += not fut.done() and time.time() - t0 < 0.5
                time.sleep(0.02)
            assert fut.result().status_code in (200, 400), fut.result().text
        assert answered >= 2, (path, answered)


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_still_serving_after_bad_input(client, http):
    assert http.get("/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt="the", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3


# ---- metrics and disconnects ---------------------------------------------------------------------
def test_metrics_names(client, http):
    client.completions.create(model=MODEL, prompt="the king", max_tokens=4, **GREEDY)
    text = wait_idle(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        metric(text, "pagedllm:" + name)
    assert metric(text, "pagedllm:generation_tokens_total") > 0
    assert metric(text, "pagedllm:time_to_first_token_seconds_count") > 0
    assert metric(text, "pagedllm:e2e_request_latency_seconds_count") > 0
    assert metric(text, "pagedllm:inter_token_latency_seconds_count") > 0


def test_disconnect_mid_stream_aborts_request(server, http):
    aborted_before = metric(wait_idle(http), "pagedllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "the king", "max_tokens": 250, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        running = metric(http.get("/metrics").text, "pagedllm:num_requests_running")
    # the connection is closed here, with most of the 250 tokens still to generate
    text = wait_idle(http)
    assert running == 1
    assert metric(text, "pagedllm:request_success_total", finished_reason="abort") == aborted_before + 1

    # a non-streaming client that gives up is aborted too: one count per choice
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "n": 16, "stream": False},
                   timeout=httpx.Timeout(60, read=0.2))
    text = wait_idle(http)
    assert metric(text, "pagedllm:request_success_total", finished_reason="abort") == aborted_before + 17
    json.loads(http.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False}).text)
