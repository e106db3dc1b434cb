"""Each setting is written once (a field of EngineArgs or ServerArgs, pagedllm/engine/arg_utils.py): the
CLI flags, LLM's keywords and their defaults all come from those fields."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs, ServerArgs, cli_flag, parse_size
from pagedllm.entrypoints.cli import build_parser
from pagedllm.layers.attention.kv_quant import CHOICES as KV_CACHE_DTYPES
from pagedllm.layers.attention.selector import CHOICES as ATTENTION_BACKENDS

CLASSES = (EngineArgs, ServerArgs)


@pytest.mark.parametrize("cls", CLASSES)
def test_every_field_has_help(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata["help"].strip(), f.name


@pytest.mark.parametrize("cls", CLASSES)
def test_one_argument_per_field(cls):
    parser = cls.add_cli_args(argparse.ArgumentParser())
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    assert sorted(dests) == sorted(cls.field_names())
    for action in parser._actions:
        if action.dest != "help" and action.option_strings:
            assert action.option_strings[0] == cli_flag(action.dest)


def test_serve_parser_has_each_field_once():
    sub = build_parser()._subparsers._group_actions[0].choices
    for command, extra in (("serve", set()), ("run-batch", {"input_file", "output_file"})):
        # (the "vLLM compatibility" group: vLLM's other flags and --no-X forms, tests/test_vllm_flags.py)
        vllm = {id(a) for g in sub[command]._action_groups if g.title == "vLLM compatibility" for a in g._group_actions}
        dests = [a.dest for a in sub[command]._actions if a.dest != "help" and id(a) not in vllm]
        assert len(dests) == len(set(dests))
        assert set(dests) == set(EngineArgs.field_names()) | set(ServerArgs.field_names()) | extra


@pytest.mark.parametrize("command", [["serve"], ["run-batch", "-i", "a", "-o", "b"]])
def test_cli_defaults_are_the_fields_defaults(command):
    args = build_parser().parse_args(command)
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert ServerArgs.from_cli_args(args) == ServerArgs()
    assert EngineArgs().device is None and args.device == "auto"  # "auto" on the CLI is the field's None


def test_flags_aliases_and_conversions():
    args = build_parser().parse_args(
        ["serve", "m", "-tp", "2", "-pp", "3", "-dp", "4", "-q", "int8", "--kv-cache-memory", "512MiB",
         "--no-enable-prefix-caching", "--device", "cpu", "--max-request-bytes", "1K", "--no-dashboard",
         "--gpu-memory-utilization", "0.5", "--headless"])
    engine, server = EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args)
    assert (engine.model, engine.tensor_parallel_size, engine.pipeline_parallel_size) == ("m", 2, 3)
    assert (engine.quantization, engine.kv_cache_memory, engine.enable_prefix_caching) == ("int8", 512 << 20, False)
    assert (engine.device, engine.gpu_memory_utilization) == ("cpu", 0.5)
    assert (server.data_parallel_size, server.max_request_bytes, server.dashboard, server.headless) == (4, 1024, False,
                                                                                                      True)
    assert parse_size("1.5GB") == 1_500_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="not a size in bytes"):
        parse_size("lots")


def test_bad_flag_values_are_refused(capsys):
    for argv, message in ((["--kv-cache-memory", "0"], "size must be positive"),
                          (["--dtype", "float8"], "invalid choice: 'float8'"),
                          (["--max-model-len", "x"], "invalid int value: 'x'")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
        assert message in capsys.readouterr().err


def test_choices_follow_the_registries():
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert list(fields["attention_backend"].metadata["choices"]) == list(ATTENTION_BACKENDS)
    assert list(fields["kv_cache_dtype"].metadata["choices"]) == list(KV_CACHE_DTYPES)


def test_llm_rejects_an_unknown_keyword():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_model_length' \(did you mean "
                                        r"'max_model_len'\?\)"):
        LLM(max_model_length=64)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        LLM(colour="blue")


def test_llm_takes_every_engine_field(monkeypatch):
    """LLM(**kwargs) builds EngineArgs from exactly its keywords (no second list of defaults)."""
    from pagedllm.engine import llm_engine

    seen = []
    monkeypatch.setattr(llm_engine.LLMEngine, "from_engine_args", classmethod(lambda cls, args: seen.append(args)))
    LLM()
    LLM("m", max_model_len=64, nnodes=1, served_model_name="x", device="cpu")
    assert seen[0] == EngineArgs()
    assert seen[1] == EngineArgs(model="m", max_model_len=64, served_model_name="x", device="cpu")
    for f in dataclasses.fields(EngineArgs):
        assert f.name in LLM.__doc__, f.name  # the generated "Settings" section lists every field
