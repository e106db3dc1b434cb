"""``pagedllm run-batch``: a file of OpenAI Batch API requests runs through the server's handlers
without a server; results come back one line per request in input order, equal to what the offline
API generates (greedy), with the server's status codes and error bodies for bad requests and an
``error`` for lines that are not requests."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import build_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main

ENGINE = ["--served-model-name", "tiny", "--kv-cache-memory", "4MiB", "--max-model-len", "256"]


def write_lines(path, lines) -> None:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))


def read_lines(path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_chat_and_completions_batch(llama_dir, tmp_path, capsys):
    prompts = ["the king", "the queen said", "o romeo"] * 4
    lines = [{"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0}} for i, p in enumerate(prompts)]
    lines += [{"custom_id": "chat", "url": "/v1/chat/completions",
               "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
              {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
               "body": {"model": "tiny", "prompt": "x", "max_tokens": 5000}},
              {"custom_id": "other-model", "method": "POST", "url": "/v1/completions",
               "body": {"model": "gpt-4", "prompt": "x"}},
              {"custom_id": "url", "method": "POST", "url": "/v1/images", "body": {}},
              {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
              {"custom_id": "stream", "method": "POST", "url": "/v1/completions",
               "body": {"model": "tiny", "prompt": "x", "stream": True}},
              "{not json"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, lines)
    assert main(["run-batch", "-i", str(src), "-o", str(dst), llama_dir, *ENGINE]) == 0
    assert "19 requests, 13 succeeded, 6 failed" in capsys.readouterr().err
    out = read_lines(dst)
    assert [r["custom_id"] for r in out] == [ln["custom_id"] for ln in lines[:-1]] + [None]
    llm = LLM(llama_dir, kv_cache_memory=4 << 20, max_model_len=256)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                                                     use_tqdm=False)]
    got = [r["response"]["body"]["choices"][0]["text"] for r in out[:12]]
    assert got == want and all(r["response"]["status_code"] == 200 and r["error"] is None for r in out[:13])
    assert out[12]["response"]["body"]["object"] == "chat.completion"
    assert out[13]["response"]["status_code"] == 400 and out[13]["response"]["body"]["error"]["param"] == "max_tokens"
    assert out[14]["response"]["status_code"] == 404
    assert [r["error"]["code"] for r in out[15:]] == ["invalid_url", "invalid_request", "invalid_request",
                                                      "invalid_json"]
    assert all(r["response"] is None for r in out[15:])


def test_embeddings_batch_and_bad_files(tmp_path, capsys):
    d = build_checkpoint(str(tmp_path / "m"), "qwen3", seed=2)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "tiny", "input": ["the king", "a"]}}])
    assert main(["run-batch", "-i", str(src), "-o", str(dst), d, *ENGINE, "--runner", "pooling"]) == 0
    body = read_lines(dst)[0]["response"]["body"]
    llm = LLM(d, runner="pooling", kv_cache_memory=4 << 20, max_model_len=256)
    want = torch.tensor([o.outputs.embedding for o in llm.embed(["the king", "a"], use_tqdm=False)])
    torch.testing.assert_close(torch.tensor([x["embedding"] for x in body["data"]]), want, rtol=0, atol=1e-6)
    capsys.readouterr()
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(dst), d, *ENGINE]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--kv-cache-memory"])
def test_run_batch_takes_the_engine_flags(flag):
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["run-batch", "-i", "a", "-o", "b", "m", flag, "2"])
    assert args.input_file == "a" and args.output_file == "b" and args.model == "m"


def test_input_and_output_files(llama_dir, tmp_path, capsys):
    """Lines end at newlines only (U+2028 inside a JSON string stays in its line); a BOM and CRLF are
    read; an unreadable output path or a file that is not UTF-8 fails at once, before any model is
    loaded (a one-line error)."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "x\u2028y", "max_tokens": 2}}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps(line, ensure_ascii=False).encode() + b"\r\n"
                    + json.dumps({**line, "custom_id": "b"}).encode() + b"\n")
    assert main(["run-batch", "-i", str(src), "-o", str(dst), llama_dir, *ENGINE]) == 0
    out = read_lines(dst)
    assert [r["custom_id"] for r in out] == ["a", "b"] and all(r["response"]["status_code"] == 200 for r in out)
    capsys.readouterr()
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "no" / "dir.jsonl"), "/nonexistent-model"]) == 1
    assert "cannot write" in capsys.readouterr().err  # (the model path was never looked at)
    src.write_bytes(b'{"custom_id": "caf\xe9"}\n')
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "/nonexistent-model"]) == 1
    assert "cannot read" in capsys.readouterr().err
