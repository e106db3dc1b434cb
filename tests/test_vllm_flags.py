"""vLLM launch lines start pagedllm: every `vllm serve` flag of tests/data/vllm_serve_flags.txt parses (applied,
ignored with one warning line, or refused with a message naming it), and the launch lines of vLLM's own
quickstart / Docker / Kubernetes docs start a real server."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import httpx
import pytest

from pagedllm.config import DEMO_MODEL_PATH
from pagedllm.engine import vllm_compat
from pagedllm.entrypoints import cli
from server_utils import RemoteServer, metric, wait_idle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "vllm_serve_flags.txt")
# Known flags that another branch adds as an EngineArgs field (until it is merged the flag may be absent here).
ADDED_ELSEWHERE = {"--enforce-eager"}
# A plausible value per value-taking flag where "1" would not be one (the rest get "1" or their first choice).
SAMPLES = {
    "--host": "0.0.0.0", "--limit-mm-per-prompt": '{"image": 1}', "--api-key": "token-abc123", "--chat-template": "{{ messages[0]['content'] }}",
    "--tokenizer": DEMO_MODEL_PATH, "--model": DEMO_MODEL_PATH, "--served-model-name": "demo",
    "--quantization": "int8", "--dtype": "half", "--load-format": "auto", "--reasoning-parser": "deepseek_r1",
    "--tool-call-parser": "hermes", "--distributed-executor-backend": "mp", "--kv-cache-dtype": "auto",
    "--block-size": "16", "--gpu-memory-utilization": "0.5", "--task": "generate", "--tokenizer-mode": "auto",
    "--config-format": "auto", "--generation-config": "vllm", "--logprobs-mode": "raw_logprobs",
    "--response-role": "assistant", "--revision": "main", "--tokenizer-revision": "main",
    "--allowed-origins": '["*"]', "--allowed-methods": '["*"]', "--allowed-headers": '["*"]',
    "--structured-outputs-config": '{"backend": "xgrammar"}', "--compilation-config": '{"level": 3}',
    "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 4}', "--scheduling-policy": "fcfs",
    "--download-dir": "/tmp/models", "--swap-space": "4", "--uvicorn-log-level": "info",
    "--runner": "pooling", "--kv-cache-memory-bytes": "2G", "--convert": "auto",
    "--config": os.path.join(ROOT, "tests", "data", "vllm_config.yaml"),
}
# vLLM flags pagedllm must refuse, with a value that would change results (the rest are accepted).
REFUSED = {
    "--rope-scaling": ['{"rope_type": "yarn"}'],
    "--rope-theta": ["1e6"], "--hf-overrides": ['{"a": 1}'], "--ssl-keyfile": ["k.pem"], "--uds": ["/tmp/s"],
    "--task": ["classify"], "--tokenizer-mode": ["mistral"], "--generation-config": ["/some/folder"],
    "--override-generation-config": ['{"temperature": 0.5}'], "--disable-sliding-window": [],
    "--skip-tokenizer-init": [], "--return-tokens-as-token-ids": [], "--revision": ["v1.0"],
    "--response-role": ["bot"], "--logprobs-mode": ["processed_logits"], "--middleware": ["m.Mw"],
    "--guided-decoding-disable-any-whitespace": [],
}


def vllm_flags() -> list[tuple[str, str, list[str]]]:
    """(flag, kind, choices) per line of the data file."""
    rows = []
    with open(DATA, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            parts = line.split()
            rows.append((parts[0], parts[1], parts[2].split(",") if len(parts) > 2 else []))
    return rows


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def parse(line: str) -> argparse.Namespace:
    """``pagedllm serve ...`` parsed as main() parses it (argv normalized first)."""
    return cli.build_parser().parse_args(vllm_compat.normalize_argv(shlex.split(line)))


def sample_args(flag: str, kind: str, choices: list[str]) -> list[str]:
    if kind in ("bool", "flag"):
        return [flag]
    value = SAMPLES.get(flag) or (choices[0] if choices else "1")
    return [flag, value]


def test_data_file_is_vllms_list():
    rows = vllm_flags()
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)) > 150
    assert {"--swap-space", "--disable-log-requests", "--trust-remote-code", "--structured-outputs-config",
            "--enforce-eager", "--max-model-len"} <= set(names)
    assert all(kind in vllm_compat.KINDS for _, kind, _ in rows)


@pytest.mark.parametrize("flag,kind,choices", vllm_flags(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_vllm_flag_parses(flag, kind, choices):
    if flag in ADDED_ELSEWHERE and flag not in serve_parser()._option_string_actions:
        pytest.skip(f"{flag} is added as an EngineArgs field by another branch")
    args = parse(shlex.join(["serve", DEMO_MODEL_PATH, *sample_args(flag, kind, choices)]))
    if kind == "bool":  # vLLM's booleans take --no-X too
        parse(shlex.join(["serve", DEMO_MODEL_PATH, "--no-" + flag[2:]]))
    spec = vllm_compat.VLLM_FLAGS.get(flag)
    if spec is None or flag in serve_parser()._option_string_actions and vllm_compat._dest(flag) not in vars(args):
        return  # a pagedllm flag under vLLM's name: applied (its own tests cover it)
    assert flag in vllm_compat.given(args)
    try:
        warning = vllm_compat.check(args)
    except ValueError as e:  # refused: only a flag whose table entry refuses it, and the message names it
        assert spec.refuse is not None and f"vLLM's {flag}" in str(e) and spec.why in str(e)
        return
    if spec.apply is None:
        assert warning is not None and f"{flag} ({spec.why})" in warning


def test_value_flags_consume_their_value_and_booleans_do_not():
    args = parse(f"serve --swap-space 4 --disable-log-stats {DEMO_MODEL_PATH} --max-log-len=100")
    assert args.model == DEMO_MODEL_PATH
    given = vllm_compat.given(args)
    assert given["--swap-space"] == ["4"] and given["--max-log-len"] == ["100"] and given["--disable-log-stats"]


def test_short_aliases():
    args = parse(f"serve {DEMO_MODEL_PATH} -O3 -asc 2 -dpl 1 -dpa 10.0.0.1 -dpp 13345 -dpr 0 -dpn 0 -dpb mp -dcp 1 "
                 "-dp 2")
    given = vllm_compat.given(args)
    assert given["--compilation-config"] == ["3"] and given["--api-server-count"] == ["2"]
    assert given["--data-parallel-size-local"] == ["1"] and given["--data-parallel-address"] == ["10.0.0.1"]
    assert given["--data-parallel-backend"] == ["mp"] and given["--decode-context-parallel-size"] == ["1"]
    assert args.data_parallel_size == 2  # and -dpl 1 is not -dp "l"
    assert "--compilation-config" in vllm_compat.check(args)


def test_dotted_and_equals_forms():
    args = parse("serve --structured-outputs-config.backend xgrammar --structured-outputs-config.disable_fallback=true "
                 "--compilation-config.cudagraph_capture_sizes+ 8 --speculative-config.method=ngram "
                 f"{DEMO_MODEL_PATH}")
    assert args.model == DEMO_MODEL_PATH
    given = vllm_compat.given(args)
    assert given["--structured-outputs-config"] == ["backend=xgrammar", "disable_fallback=true"]
    assert given["--compilation-config"] == ["cudagraph_capture_sizes=8"]
    assert args.speculative_config == [{"method": "ngram"}]  # a setting (EngineArgs merges the parts)
    with pytest.raises(ValueError, match="--structured-outputs-config"):
        vllm_compat.check(parse("serve --structured-outputs-config.disable_any_whitespace true"))


def test_one_warning_line_names_the_no_effect_flags_given():
    args = parse(f"serve {DEMO_MODEL_PATH} --disable-log-requests --swap-space 16 --uvicorn-log-level warning "
                 "--trust-remote-code --guided-decoding-backend xgrammar --max-model-len 128")
    warning = vllm_compat.check(args)
    assert "\n" not in warning
    for flag in ("--disable-log-requests", "--swap-space", "--uvicorn-log-level", "--trust-remote-code"):
        assert flag in warning
    assert "--guided-decoding-backend" not in warning  # applied (the undeclared-properties rule)
    assert "--max-model-len" not in warning  # a pagedllm flag: applied, not warned about
    assert args.max_model_len == 128
    assert vllm_compat.check(parse(f"serve {DEMO_MODEL_PATH} --max-model-len 128")) is None


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flags_that_would_change_results_are_refused(flag):
    args = parse(shlex.join(["serve", DEMO_MODEL_PATH, flag, *REFUSED[flag]]))
    with pytest.raises(ValueError, match=flag.replace("-", r"\-") + ".*would change results"):
        vllm_compat.check(args)


def test_trust_remote_code(tmp_path):
    """No effect for a model pagedllm implements; refused, naming the architecture, for one needing remote code."""
    warning = vllm_compat.check(parse(f"serve {DEMO_MODEL_PATH} --trust-remote-code"))
    assert "--trust-remote-code (pagedllm runs only its own model implementations" in warning
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MyCustomForCausalLM"], "model_type": "my_custom",
        "auto_map": {"AutoModelForCausalLM": "modeling_my.MyCustomForCausalLM"}}))
    with pytest.raises(ValueError, match="--trust-remote-code: .* needs its own model code \\(auto_map\\) for "
                                         "MyCustomForCausalLM, and pagedllm runs only its own implementations"):
        vllm_compat.check(parse(f"serve {tmp_path} --trust-remote-code"))
    assert vllm_compat.check(parse(f"serve {tmp_path} --no-trust-remote-code")) is not None  # off: no refusal


def test_applied_aliases():
    args = parse("serve --model /x/y --task embed --disable-uvicorn-access-log --no-enable-auto-tool-choice "
                 "--dtype float")
    assert vllm_compat.check(args) is None
    assert (args.model, args.runner, args.disable_access_log, args.enable_auto_tool_choice, args.dtype) == (
        "/x/y", "pooling", True, False, "float")
    with pytest.raises(ValueError, match="given twice"):
        vllm_compat.check(parse("serve /a --model /b"))


def test_kv_cache_memory_bytes_is_kv_cache_memory():
    args = parse(f"serve {DEMO_MODEL_PATH} --kv-cache-memory-bytes 2G")
    assert vllm_compat.check(args) is None and args.kv_cache_memory == 2 << 30
    assert vllm_compat.vllm_int("25.6k") == 25600 and vllm_compat.vllm_int("3M") == 3 << 20
    with pytest.raises(ValueError, match="disagree"):
        vllm_compat.check(parse(f"serve {DEMO_MODEL_PATH} --kv-cache-memory-bytes 2G --kv-cache-memory 1GiB"))


def test_config_file(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("max-model-len: 64\nswap_space: 2\ndisable-log-requests: true\nenable-prefix-caching: false\n")
    args = parse(f"serve {DEMO_MODEL_PATH} --config {cfg} --port 9001")
    assert (args.max_model_len, args.port) == (64, 9001)
    assert vllm_compat.given(args)["--swap-space"] == ["2"]
    with pytest.raises(SystemExit):  # an unreadable file: argparse's error
        cli.main(["serve", "--config", str(tmp_path / "missing.yaml")])


def test_refused_flag_stops_start_up_with_a_message():
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", DEMO_MODEL_PATH, "--rope-theta",
                           "1e6"], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2
    assert ("pagedllm serve: error: vLLM's --rope-theta 1e6 is not supported here and would change results"
            in proc.stderr)


# Launch lines from vLLM's docs (the model replaced by MODEL): quickstart, Docker, Kubernetes (its container args),
# and a production-stack style line.
DOC_LAUNCH_LINES = [
    # "OpenAI-Compatible Server" page
    "vllm serve MODEL --dtype auto --api-key token-abc123",
    # "Using Docker": `docker run ... vllm/vllm-openai:latest --model MODEL` (the image's entrypoint is vllm serve)
    "vllm serve --model MODEL",
    # "Using Kubernetes": the container's args
    "vllm serve MODEL --trust-remote-code --enable-chunked-prefill --max_num_batched_tokens 1024",
    # not from one page: the flags issue 43 found stopping start-up, as launch lines combine them
    "vllm serve MODEL --host 0.0.0.0 --port 8000 --swap-space 16 --disable-log-requests --disable-log-stats "
    "--uvicorn-log-level warning --generation-config vllm --enable-auto-tool-choice --tool-call-parser hermes "
    "--chat-template-content-format string --guided-decoding-backend xgrammar --max-log-len 100 "
    "--structured-outputs-config.backend xgrammar --tool-parser-plugin p.py --download-dir /data "
    "--enable-prompt-tokens-details --enable-tokenizer-info-endpoint --enforce-eager",
]


def launch_argv(line: str, model: str) -> list[str]:
    words = shlex.split(line.replace("MODEL", model))
    assert words[:2] == ["vllm", "serve"]
    return ["serve", *words[2:]]


@pytest.mark.parametrize("line", DOC_LAUNCH_LINES)
def test_doc_launch_lines_parse(line):
    argv = launch_argv(line, DEMO_MODEL_PATH)
    if "--enforce-eager" in argv and "--enforce-eager" not in serve_parser()._option_string_actions:
        argv.remove("--enforce-eager")  # added by another branch
    args = cli.build_parser().parse_args(vllm_compat.normalize_argv(argv))
    vllm_compat.check(args)
    assert args.model == DEMO_MODEL_PATH
    if "--max_num_batched_tokens" in line:
        assert args.max_num_batched_tokens == 1024


def test_quickstart_launch_line_starts_and_serves_vllm_metrics():
    """vLLM's quickstart line on the demo model, a few requests, then every vllm:* series equals its pagedllm:* one."""
    argv = launch_argv(DOC_LAUNCH_LINES[0] + " --disable-log-requests --swap-space 4", DEMO_MODEL_PATH)
    with RemoteServer(argv[1], tuple(argv[2:])) as srv:
        headers = {"Authorization": "Bearer token-abc123"}
        with httpx.Client(base_url=srv.url, timeout=120, headers=headers) as http:
            for prompt in ("the king", "the king said", "to be or"):
                r = http.post("/v1/completions", json={"model": DEMO_MODEL_PATH, "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0})
                assert r.status_code == 200, r.text
            text = wait_idle(http)
        no_key = httpx.post(srv.url + "/v1/completions", json={"model": DEMO_MODEL_PATH, "prompt": "a"}, timeout=30)
        assert no_key.status_code == 401  # --api-key applied
        log = srv.log()
    warnings = [ln for ln in log.splitlines() if "vLLM flags with no effect" in ln]
    assert len(warnings) == 1 and "--disable-log-requests" in warnings[0] and "--swap-space" in warnings[0]
    assert "--api-key" not in warnings[0] and "--dtype" not in warnings[0]
    assert metric(text, "vllm:generation_tokens_total") == metric(text, "pagedllm:generation_tokens_total") > 0
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 3
    for ours, theirs in (("num_requests_running", "num_requests_running"),
                         ("num_requests_waiting", "num_requests_waiting"),
                         ("kv_cache_usage_perc", "kv_cache_usage_perc"),
                         ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                         ("prompt_tokens_total", "prompt_tokens_total"),
                         ("num_preemptions_total", "num_preemptions_total"),
                         ("prefix_cache_queries_total", "prefix_cache_queries_total"),
                         ("prefix_cache_hits_total", "prefix_cache_hits_total"),
                         ("time_to_first_token_seconds_count", "time_to_first_token_seconds_count"),
                         ("time_to_first_token_seconds_sum", "time_to_first_token_seconds_sum"),
                         ("inter_token_latency_seconds_count", "inter_token_latency_seconds_count"),
                         ("inter_token_latency_seconds_count", "time_per_output_token_seconds_count"),
                         ("e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_sum")):
        assert metric(text, "vllm:" + theirs) == metric(text, "pagedllm:" + ours), theirs
    assert f'vllm:num_requests_running{{model_name="{DEMO_MODEL_PATH}"}}' in text
