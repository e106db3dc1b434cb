"""Undeclared JSON properties follow vLLM: refused by default (vLLM's default backend, xgrammar, in
its strict mode; its guidance backend with disable_additional_properties), admitted where the server
runs as vLLM's guidance backend does by default (``--json-additional-properties allow``, or vLLM's
``--structured-outputs-config backend=guidance``), refused again per request by
``structured_outputs.disable_additional_properties`` or OpenAI's ``strict: true``. A schema that says
``additionalProperties`` is obeyed in every mode. Checked on the compiled grammar: whether it accepts a
text, token by token."""
from __future__ import annotations

import shlex

import llguidance
import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints import cli
from pagedllm.engine import vllm_compat
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionToolParam, NamedToolChoice
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.tool_parsers.tool_choice import tool_choice_structured_outputs
from pagedllm.structured_output.backend import GrammarCompiler
from pagedllm.structured_output.params import StructuredOutputsParams, without_additional_properties

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
          "required": ["city"]}
DECLARED = '{"city":"Rome","where":{"lat":1.5}}'
EXTRA_TOP = '{"city":"Rome","country":"IT"}'
EXTRA_NESTED = '{"city":"Rome","where":{"lat":1.5,"lon":2}}'


@pytest.fixture(scope="module")
def compiler(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    return GrammarCompiler(tok, len(tok))


def accepts(compiler: GrammarCompiler, params: StructuredOutputsParams, text: str) -> bool:
    m = llguidance.LLMatcher(compiler.ll_tokenizer, compiler.compile(params), log_level=0)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("disable,extra_ok", [(None, False), (True, False), (False, True)])
def test_undeclared_properties_per_mode(compiler, disable, extra_ok):
    params = StructuredOutputsParams(json=SCHEMA, disable_additional_properties=disable)
    assert accepts(compiler, params, DECLARED)
    assert accepts(compiler, params, EXTRA_TOP) == extra_ok
    assert accepts(compiler, params, EXTRA_NESTED) == extra_ok


@pytest.mark.parametrize("disable", [None, True, False])
def test_a_schema_that_says_additional_properties_is_obeyed(compiler, disable):
    open_schema = {**SCHEMA, "additionalProperties": True}
    closed_schema = {**SCHEMA, "additionalProperties": False}
    assert accepts(compiler, StructuredOutputsParams(json=open_schema, disable_additional_properties=disable),
                   EXTRA_TOP)
    assert not accepts(compiler, StructuredOutputsParams(json=closed_schema, disable_additional_properties=disable),
                       EXTRA_TOP)
    # an object with no declared properties, and json_object, take any keys in every mode
    assert accepts(compiler, StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=disable),
                   EXTRA_TOP)
    assert accepts(compiler, StructuredOutputsParams(json_object=True, disable_additional_properties=disable),
                   EXTRA_TOP)


def test_the_walk_touches_schemas_only():
    schema = {"type": "object", "properties": {"properties": {"type": "string"}},
              "$defs": {"P": {"properties": {"x": {}}}}, "anyOf": [{"properties": {}}, {"type": "string"}],
              "items": [{"properties": {"y": {}}}], "unevaluatedProperties": False}
    out = without_additional_properties(schema)
    assert out["properties"] == {"properties": {"type": "string"}}  # a property named "properties" left alone
    assert "additionalProperties" not in out  # unevaluatedProperties already says it
    assert out["$defs"]["P"]["additionalProperties"] is False and out["items"][0]["additionalProperties"] is False
    assert out["anyOf"] == [{"properties": {}, "additionalProperties": False}, {"type": "string"}]
    assert "additionalProperties" not in schema["$defs"]["P"]  # a copy


class _Serving:
    resolve_additional_properties = OpenAIServing.resolve_additional_properties

    def __init__(self, allow: bool) -> None:
        self.allow_additional_properties = allow


def resolved(allow: bool, **body) -> StructuredOutputsParams:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    params = req.to_sampling_params(8)
    _Serving(allow).resolve_additional_properties(params)
    return params.structured_outputs


RF = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


@pytest.mark.parametrize("allow", [False, True])
def test_the_server_rule_and_the_request_fields(allow):
    assert resolved(allow, response_format=RF).disable_additional_properties is (not allow)
    assert resolved(allow, guided_json=SCHEMA).disable_additional_properties is (not allow)
    strict = {**RF, "json_schema": {**RF["json_schema"], "strict": True}}
    assert resolved(allow, response_format=strict).disable_additional_properties is True
    so = {"json": SCHEMA, "disable_additional_properties": True}
    assert resolved(allow, structured_outputs=so).disable_additional_properties is True
    so["disable_additional_properties"] = False  # vLLM's default value: the server's rule
    assert resolved(allow, structured_outputs=so).disable_additional_properties is (not allow)


def test_strict_tools_refuse_undeclared_arguments():
    tools = [ChatCompletionToolParam(type="function", function={"name": "f", "parameters": SCHEMA, "strict": True}),
             ChatCompletionToolParam(type="function", function={"name": "g", "parameters": SCHEMA})]
    named = tool_choice_structured_outputs(tools, NamedToolChoice(type="function", function={"name": "f"}))
    assert named.json["additionalProperties"] is False
    required = tool_choice_structured_outputs(tools, "required")
    f, g = (item["properties"]["parameters"] for item in required.json["items"]["anyOf"])
    assert f["additionalProperties"] is False and "additionalProperties" not in g


@pytest.mark.parametrize("flags,rule", [
    ("", "forbid"), ("--json-additional-properties allow", "allow"),
    ("--guided-decoding-backend xgrammar", "forbid"), ("--guided-decoding-backend guidance", "allow"),
    ("--guided-decoding-backend guidance --guided-decoding-disable-additional-properties", "forbid"),
    ("--structured-outputs-config.backend guidance", "allow"),
    ('--structured-outputs-config {"backend":"guidance","disable_additional_properties":true}', "forbid"),
    ("--structured-outputs-config.backend outlines", "forbid")])
def test_vllm_flags_set_the_rule(flags, rule):
    argv = vllm_compat.normalize_argv(["serve", "m", *shlex.split(flags)])
    args = cli.build_parser().parse_args(argv)
    warning = vllm_compat.check(args)
    assert args.json_additional_properties == rule
    assert warning is None or "backend" not in warning  # applied: not listed as having no effect


def test_other_structured_outputs_config_keys_are_named_in_the_warning():
    argv = vllm_compat.normalize_argv(["serve", "m", "--structured-outputs-config.backend", "guidance",
                                       "--structured-outputs-config.disable_fallback=true"])
    args = cli.build_parser().parse_args(argv)
    warning = vllm_compat.check(args)
    assert args.json_additional_properties == "allow" and "disable_fallback" in warning
