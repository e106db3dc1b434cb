"""A chat template that drops ``tools`` or an assistant turn's ``tool_calls`` (SmolLM2's drops both) is
found at start-up by rendering probe conversations: one warning per model, then one log line per
request that carries tools or tool calls; a template that renders them gets neither."""
from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from server_utils import RemoteServer
from test_gguf import needs_smollm2, SMOLLM2
from pagedllm.entrypoints.openai.template_probe import probe_template

# SmolLM2-135M-Instruct's own template (role and content only)
SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
TOOLS_ONLY = ("{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
              "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
BOTH = ("{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
        "{% endfor %}")
RAISES = "{{ raise_exception('no tools here') if tools else '' }}{% for m in messages %}{{ m.content }}{% endfor %}"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("template,tools,calls", [
    (SMOL_TEMPLATE, False, False), (TOOLS_ONLY, True, False), (BOTH, True, True), (RAISES, None, False)])
def test_probe(tokenizer, template, tools, calls):
    got = probe_template(tokenizer, template)
    assert (got.tools, got.tool_calls) == (tools, calls)
    warning = got.warning("m")
    assert (warning is None) == (tools is not False and calls is not False)
    if tools is False:
        assert "tool definitions" in warning and got.request_note(True, False)
    if calls is False:
        assert "tool calls" in warning and got.request_note(False, True)
    assert got.request_note(False, False) is None


@needs_smollm2
def test_smollm2_own_template_drops_both():
    from pagedllm.models.checkpoint import load_tokenizer  # (the GGUF's tokenizer and template)

    tok = load_tokenizer(SMOLLM2)
    got = probe_template(tok, None)
    assert (got.tools, got.tool_calls) == (False, False)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    (tmp / "t.jinja").write_text(SMOL_TEMPLATE)
    args = ("--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--chat-template", str(tmp / "t.jinja"))
    with RemoteServer(llama_dir, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


def test_one_warning_at_start_up_and_a_line_per_request_with_tools(server, http):
    def lines(pattern):
        return [ln for ln in server.log().splitlines() if re.search(pattern, ln)]

    assert len(lines("the chat template of tiny drops the tool definitions")) == 1
    msgs = [{"role": "user", "content": "hi"}]
    assert http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).status_code == 200
    assert not lines("from this request's prompt")
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "tools": [TOOL],
                                                "tool_choice": "none"})
    assert r.status_code == 200
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2}).status_code == 200
    assert len(lines("drops its tools from this request's prompt")) == 1
    assert len(lines("drops its earlier tool calls from this request's prompt")) == 1
    assert len(lines("the chat template of tiny drops")) == 1  # the start-up warning is not repeated
