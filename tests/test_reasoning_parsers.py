"""Reasoning parsers (``--reasoning-parser``): the split of a finished output, and streaming that
sends pieces adding up to that split whatever the chunking, with no part of a tag leaking."""
from __future__ import annotations

import random

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser

CASES = [  # text, deepseek_r1's split, qwen3's split
    ("<think>plan a</think>\n\nanswer", ("plan a", "\n\nanswer"), ("plan a", "\n\nanswer")),
    ("plan b</think>answer", ("plan b", "answer"), (None, "plan b</think>answer")),
    ("no tags at all", ("no tags at all", None), (None, "no tags at all")),
    ("<think>never closed", ("never closed", None), ("never closed", None)),
    ("<think></think>only answer", (None, "only answer"), (None, "only answer")),
    ("<think>a</think>", ("a", None), ("a", None)),
    ("x <think>y</think>z", ("x <think>y", "z"), (None, "x <think>y</think>z")),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize("name,col", [("deepseek_r1", 1), ("qwen3", 2)])
def test_split_of_a_finished_output(name, col):
    parser = get_reasoning_parser(name)
    for case in CASES:
        assert parser.split(case[0]) == case[col], case[0]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_streamed_pieces_add_up_to_the_split(name):
    parser = get_reasoning_parser(name)
    rng = random.Random(0)
    texts = [c[0] for c in CASES] + ["<think>a</thinking> still</think> done", "<think>x</", "</think>", "<"]
    for text in texts:
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 6)))) if len(text) > 1 \
                else []
            want_r, want_c = parser.split(text)
            stream, reasoning, content = ReasoningStream(parser), "", ""
            for end in cuts + [len(text)]:
                new, content = stream.delta(text[:end], end == len(text))
                reasoning += new or ""
                # Every step's pieces are prefixes of the final split: no tag, or part of one, leaks.
                assert (want_r or "").startswith(reasoning) and (want_c or "").startswith(content), (text, end)
            assert (reasoning or None, content or None) == (want_r, want_c), (text, cuts)


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; known: deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("r1")


def test_constrained_output_splits_only_a_written_thought():
    """A grammar writes the output from its first token: JSON or a forced call is content even for
    deepseek_r1 (whose opening tag is otherwise optional); a thought the grammar wrote still splits."""
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1.split('{"a": 1}', True, constrained=True) == (None, '{"a": 1}')
    assert r1.split("<think>x</think>{}", True, constrained=True) == ("x", "{}")
    assert r1.split('{"a": 1}') == ('{"a": 1}', None)


# ---- through a server with deepseek_r1 ----------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def r1_server(llama_dir, tmp_path_factory):
    from server_utils import RemoteServer
    tmp = tmp_path_factory.mktemp("r1")
    args = ("--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1")
    with RemoteServer(llama_dir, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


def post(srv, path: str, body: dict):
    import httpx
    r = httpx.post(srv.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_deepseek_r1_server(r1_server):
    import json
    msgs = [{"role": "user", "content": "the king said"}]
    # unconstrained, never closed: all reasoning, streamed or not
    whole = post(r1_server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0})
    m = whole.json()["choices"][0]["message"]
    assert m["content"] is None and m["reasoning"]
    usage = whole.json()["usage"]  # every token is the thought
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 12} and usage["completion_tokens"] == 12
    chunks = [json.loads(line[5:]) for line in post(r1_server, "/v1/chat/completions", {
        "messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}).text.splitlines()
        if line.startswith("data:") and "[DONE]" not in line]
    assert chunks[-1]["usage"] == usage
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == m["reasoning"]
    assert not any(d.get("content") for d in deltas)
    # forced outputs follow their grammar from the first token: content and calls, not reasoning
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        m = post(r1_server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 60, "tools": TOOLS,
                                                     "tool_choice": choice}).json()["choices"][0]["message"]
        assert m["reasoning"] is None and json.loads(m["tool_calls"][0]["function"]["arguments"])["a"] in (1, 2)
    r = post(r1_server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 60, "tools": TOOLS,
                                                 "tool_choice": "required"}).json()
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    m = post(r1_server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 60,
                                                 "response_format": {"type": "json_object"}}).json()
    m = m["choices"][0]["message"]
    assert m["reasoning"] is None and m["content"].lstrip().startswith("{")
    # Responses: the thought streams as it is generated, then the message at output index 1
    body = {"input": "the king said", "max_output_tokens": 40, "temperature": 0, "stream": True,
            "structured_outputs": {"regex": "<think>[a-z]{6,12}</think>[a-z]{1,6}"}}
    events = [json.loads(line[5:]) for line in post(r1_server, "/v1/responses", body).text.splitlines()
              if line.startswith("data:")]
    kinds = [e["type"] for e in events]
    # The thought streams before the message (how many deltas depends on how the engine's outputs
    # coalesce under load: at least one)
    assert kinds.count("response.reasoning_text.delta") >= 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    final = events[-1]["response"]
    thought = final["output"][0]["content"][0]["text"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert "<" not in thought + final["output"][1]["content"][0]["text"]
    # the thought's tokens (up to </think>) are reasoning tokens; the answer's are not
    assert 0 < final["usage"]["output_tokens_details"]["reasoning_tokens"] < final["usage"]["output_tokens"]
    # logprobs with a reasoning parser: the message's tokens carry them
    out = post(r1_server, "/v1/responses", {"input": "hi", "max_output_tokens": 6, "top_logprobs": 2,
                                            "structured_outputs": {"regex": "[a-z]{3,5}"}}).json()
    assert out["output"][0]["type"] == "message" and out["output"][0]["content"][0]["logprobs"]


def test_reasoning_token_counts():
    """usage's reasoning_tokens from the output's tokens: up to and including the one that completes
    </think> (deepseek_r1: all of them when it never closes; qwen3: none without an opening tag);
    gpt-oss: the tokens of its analysis messages, headers included, not those of final or of calls."""
    from pagedllm.entrypoints.openai.harmony import HarmonyReasoningParser

    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    toks = ["Let", " me", " see", "</", "think", ">", "\n", "Yes"]
    assert r1.reasoning_token_count(toks) == 6 and qwen3.reasoning_token_count(toks) == 0
    assert qwen3.reasoning_token_count(["<think>", *toks]) == 7 and r1.reasoning_token_count(toks[:3]) == 3
    assert r1.reasoning_token_count(["{", '"a"', "}"], constrained=True) == 0
    assert r1.reasoning_token_count([]) == 0
    h = HarmonyReasoningParser()
    analysis = ["<|channel|>", "analysis", "<|message|>", "hm", "m", "<|end|>"]
    call = ["<|start|>", "assistant", " to=functions.f", "<|channel|>", "commentary", "<|message|>", "{}", "<|call|>"]
    final = ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hi", "<|return|>"]
    assert h.reasoning_token_count(analysis + final) == 6
    assert h.reasoning_token_count(analysis + ["<|start|>", "assistant"] + analysis + final) == 14
    assert h.reasoning_token_count(call) == 0 and h.reasoning_token_count(["plain", " text"]) == 0
    assert h.reasoning_token_count(analysis[:4]) == 4  # cut inside the thought
