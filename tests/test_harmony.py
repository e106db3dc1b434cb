"""gpt-oss's harmony format: the analysis channel becomes ``reasoning``, final (and preambles) the
content, messages to ``functions.NAME`` tool calls (``--tool-call-parser openai``); on by default
when serving gpt-oss; ``reasoning_effort`` reaches a chat template that reads it. The server test
forces harmony text with a regex (a random model cannot choose it)."""
from __future__ import annotations

import json
import random
import re

import httpx
import pytest

from pagedllm.entrypoints.openai.harmony import parse_messages
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

ANALYSIS = "<|channel|>analysis<|message|>User asks the weather.<|end|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Rome\"}"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."


def test_split_channels():
    p = get_reasoning_parser("openai_gptoss")
    assert p.needs_special_tokens
    assert p.split(ANALYSIS + FINAL) == ("User asks the weather.", "It is sunny.")
    assert p.split(ANALYSIS + ANALYSIS.replace("User asks", "Then")) == (
        "User asks the weather.\nThen the weather.", None)
    assert parse_messages(ANALYSIS + CALL) == [("analysis", None, "User asks the weather.", True),
                                               ("commentary", "functions.get_weather", '{"city":"Rome"}', False)]
    # the recipient in the role part; a preamble (commentary, no recipient) is content
    role_call = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"
    assert p.split(ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" + role_call) == (
        "User asks the weather.", "Let me check.<|call|>f<|message|>{}<|end|>")
    assert p.split("plain words") == (None, "plain words")  # not harmony (a constrained output): content
    assert p.split("hi <|channel|>analysis<|message|>x<|end|>") == ("x", "hi ")  # text before the first header
    assert p.split(" to=functions.f<|channel|>commentary json<|message|>{}") == (None, "<|call|>f<|message|>{}<|end|>")
    # a call no tool parser reads is left out of the content
    assert p.without_tool_calls("a<|call|>f<|message|>{}<|end|>b", True) == "ab"
    assert p.without_tool_calls("a<|call|>f<|message|>{", False) == "a"
    assert p.split(ANALYSIS[:34], finished=False) == ("User", None)
    assert p.split(ANALYSIS[:-3], finished=False) == ("User asks the weather.", None)  # "<|e" held back


def test_openai_tool_parser_whole_and_streamed():
    reasoning, content = get_reasoning_parser("openai_gptoss").split(ANALYSIS + CALL)
    parser = get_tool_parser("openai")(None)
    got = parser.extract_tool_calls(content)
    assert got.tools_called and got.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Rome"})]
    # streamed: text around the call as it comes, the call opened with its name, then its arguments
    # character by character (a closing <|end|> held back while it may be arriving)
    text = "Checking." + content + "It is sunny."
    streamer, sent, calls = get_tool_parser("openai")(None), "", []
    for end in range(1, len(text) + 1):
        d = streamer.extract_tool_calls_streaming(text[:end - 1], text[:end], text[end - 1], end == len(text))
        if d is not None:
            sent += d.content or ""
            calls += d.tool_calls or []
    assert sent == "Checking.It is sunny." and [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert streamer.called and calls[0].id and all(c.index == 0 and c.id is None for c in calls[1:])
    assert len(calls) > 5 and "".join(c.function.arguments for c in calls) == got.tool_calls[0].function.arguments
    assert json.loads(got.tool_calls[0].function.arguments) == {"city": "Rome"}
    # cut by max_tokens inside the arguments: a call with the arguments so far, streamed or not
    cut = content[:content.index("Rome") + 2]
    whole = get_tool_parser("openai")(None).extract_tool_calls(cut)
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [("get_weather", '{"city":"Ro')]


def test_streamed_pieces_add_up_to_the_split():
    p = get_reasoning_parser("openai_gptoss")
    rng = random.Random(1)
    for text in (ANALYSIS + FINAL, ANALYSIS + CALL, ANALYSIS + ANALYSIS + FINAL, "no format",
                 "hi " + ANALYSIS + FINAL, " to=functions.f<|channel|>commentary json<|message|>{}" + FINAL,
                 ANALYSIS + CALL + "<|call|>" + FINAL):
        want_r, want_c = p.split(text)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 8)))
            stream, reasoning = ReasoningStream(p), ""
            for end in cuts + [len(text)]:
                new, content = stream.delta(text[:end], end == len(text))
                reasoning += new or ""
                assert (want_r or "").startswith(reasoning), (text, end)
                shown = p.without_tool_calls(content, end == len(text))
                assert p.without_tool_calls(want_c or "", True).startswith(shown), (text, end)  # only grows
            assert (reasoning or None, content or None) == (want_r, want_c)


# ---- a served gpt-oss ---------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_utils import RemoteServer
    from test_gpt_oss import build_gpt_oss
    tmp = tmp_path_factory.mktemp("harmony")
    model = build_gpt_oss(str(tmp / "model"), seed=1, max_position_embeddings=512)
    (tmp / "t.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", "oss", "--max-model-len", "512", "--kv-cache-memory", "4MiB",
            "--chat-template", str(tmp / "t.jinja"), "--enable-auto-tool-choice", "--tool-call-parser", "openai")
    with RemoteServer(model, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


def chat(srv, **body):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "oss", "messages": MSGS, "max_tokens": 400, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r


def test_served_gpt_oss_reads_its_channels(server):
    assert "reading its harmony channels" in server.log()
    regex = re.escape("<|channel|>analysis<|message|>") + "[a-z]{3,8}" + re.escape(
        "<|end|><|start|>assistant<|channel|>final<|message|>") + "[a-z]{2,6}"
    m = chat(server, guided_regex=regex).json()["choices"][0]["message"]
    assert re.fullmatch("[a-z]{3,8}", m["reasoning"]) and re.fullmatch("[a-z]{2,6}", m["content"])
    lines = chat(server, guided_regex=regex, stream=True).text.splitlines()
    deltas = [json.loads(x[5:])["choices"][0]["delta"] for x in lines if x.startswith("data:") and "[DONE]" not in x
              and json.loads(x[5:])["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == m["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == m["content"]
    # a call to functions.get_weather is a tool call
    call_regex = re.escape(ANALYSIS + CALL)
    c = chat(server, guided_regex=call_regex, tools=TOOLS).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["reasoning"] == "User asks the weather."
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]] == [
        ("get_weather", {"city": "Rome"})]
    # without tools, a call is not shown as text (nor the parser's call markers)
    for stream in (False, True):
        r = chat(server, guided_regex=call_regex, stream=stream)
        if stream:
            deltas = [json.loads(x[5:])["choices"][0]["delta"] for x in r.text.splitlines()
                      if x.startswith("data:") and "[DONE]" not in x and json.loads(x[5:])["choices"]]
            content = "".join(d.get("content") or "" for d in deltas)
        else:
            content = r.json()["choices"][0]["message"]["content"] or ""
        assert content == "" and "<|" not in content, content
    # reasoning_effort reaches the template (the prompt grows by "Reasoning: high"), if low/medium/high
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "oss", "messages": MSGS, "max_tokens": 1, "reasoning_effort": "bogus"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    plain = chat(server, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert chat(server, max_tokens=1, reasoning_effort="high").json()["usage"]["prompt_tokens"] > plain
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "oss", "input": "weather?", "max_output_tokens": 120, "temperature": 0,
        "reasoning": {"effort": "low"}, "structured_outputs": {"regex": regex}})
    assert [item["type"] for item in r.json()["output"]] == ["reasoning", "message"], r.text


def test_special_tokens_come_back_whole_when_kept(tmp_path):
    """The harmony parser reads special tokens from the text: with skip_special_tokens=False each
    comes back as its whole string (and none with the default)."""
    import transformers
    from conftest import build_checkpoint
    from pagedllm import LLM, SamplingParams
    d = build_checkpoint(str(tmp_path), "llama", vocab_size=520)  # room for the added tokens
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>"]})
    tok.save_pretrained(d)
    ids = tok.convert_tokens_to_ids(["<|channel|>", "<|message|>"])
    assert max(ids) < 520
    llm = LLM(d, kv_cache_memory=1 << 20)
    kept, skipped = (llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                              allowed_token_ids=ids, skip_special_tokens=skip),
                                  use_tqdm=False)[0].outputs[0] for skip in (False, True))
    assert kept.text == "".join(tok.convert_ids_to_tokens(kept.token_ids)) and len(kept.token_ids) == 6
    assert skipped.text == ""
