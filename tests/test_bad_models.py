"""Bad models get one clear line: ``pagedllm serve`` prints one ``pagedllm serve: error: ...`` line and
exits 1 (never a traceback); ``LLM`` raises ValueError with the same message."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import build_checkpoint
from pagedllm import LLM
from server_utils import free_port
from test_gguf import write_llama_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[str, str]:
    """(HF folder, GGUF file) of a tiny Llama that loads."""
    root = tmp_path_factory.mktemp("good")
    hf_dir = build_checkpoint(str(root / "hf"), "llama", seed=7)
    path = str(root / "good.gguf")
    write_llama_gguf(hf_dir, path, ("F32", "Q8_0"))
    return hf_dir, path


def _copy_hf(good, tmp_path, **config_changes) -> str:
    d = str(tmp_path / "model")
    shutil.copytree(good[0], d)
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(config_changes)
    json.dump(cfg, open(cfg_path, "w"))
    return d


def _copy_gguf(good, tmp_path) -> str:
    p = str(tmp_path / "model.gguf")
    shutil.copy(good[1], p)
    return p


def _set_tensor_type(path: str, type_id: int) -> None:
    """Overwrite the GGML type id of the file's first tensor (in its tensor-info header)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    part = r.tensors[0].field.parts[4]  # name length, name, n_dims, dims, type, data offset
    offset = part.__array_interface__["data"][0] - r.data.__array_interface__["data"][0]
    del r
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(int(type_id).to_bytes(4, "little"))


def _truncate(path: str, fraction: float) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * fraction))


def _scribble(path: str, start: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * n)


# kind -> how a copy of the good GGUF file is damaged
GGUF_DAMAGE = {
    "gguf_quant_not_dequantizable": lambda p: _set_tensor_type(p, 9),  # Q8_1: a GGML type gguf cannot dequantize
    "gguf_unknown_quant_type": lambda p: _set_tensor_type(p, 99),
    "gguf_truncated": lambda p: _truncate(p, 0.6),
    "gguf_corrupt": lambda p: _scribble(p, 4, 40),  # version, counts and the first key
}


def make_bad(kind: str, good, tmp_path) -> str:
    if kind == "missing_path":
        return str(tmp_path / "no" / "such" / "model")
    if kind == "unknown_hub_id":
        return "no-such-org/no-such-model"  # conftest sets HF_HUB_OFFLINE=1: the lookup fails at once
    if kind == "missing_gguf":
        return str(tmp_path / "model.gguf")
    if kind == "folder_without_config":
        (tmp_path / "README.md").write_text("not a model")
        return str(tmp_path)
    if kind == "unsupported_architecture":
        return _copy_hf(good, tmp_path, architectures=["FancyNewForCausalLM"])
    if kind == "unknown_model_type":
        return _copy_hf(good, tmp_path, model_type="fancy-new", architectures=["FancyNewForCausalLM"])
    if kind == "shape_mismatch":
        return _copy_hf(good, tmp_path, intermediate_size=96)
    if kind == "safetensors_truncated":
        d = _copy_hf(good, tmp_path)
        _truncate(os.path.join(d, "model.safetensors"), 0.5)
        return d
    if kind == "safetensors_corrupt":
        d = _copy_hf(good, tmp_path)
        _scribble(os.path.join(d, "model.safetensors"), 8, 32)  # inside the JSON header
        return d
    if kind in GGUF_DAMAGE:
        p = _copy_gguf(good, tmp_path)
        GGUF_DAMAGE[kind](p)
        return p
    if kind == "gguf_unknown_architecture":
        p = str(tmp_path / "fancy.gguf")
        write_llama_gguf(good[0], p, ("F32",), arch="fancyarch")
        return p
    if kind == "not_a_model_file":
        p = tmp_path / "notes.txt"
        p.write_text("hello")
        return str(p)
    raise AssertionError(kind)


# kind -> words the message must contain
CASES = {
    "missing_path": ["does not exist"],
    "missing_gguf": ["does not exist"],
    "unknown_hub_id": ["not a local path", "Hugging Face hub"],
    "folder_without_config": ["no config.json"],
    "unsupported_architecture": ["FancyNewForCausalLM", "not supported", "LlamaForCausalLM", "Qwen2ForCausalLM"],
    "unknown_model_type": ["fancy-new", "LlamaForCausalLM"],
    "shape_mismatch": ["mlp", "shape"],
    "safetensors_truncated": ["model.safetensors"],
    "safetensors_corrupt": ["model.safetensors", "corrupt"],
    "gguf_quant_not_dequantizable": ["Q8_1", "cannot dequantize", "Q4_K"],
    "gguf_unknown_quant_type": ["unknown quant type", "99"],
    "gguf_unknown_architecture": ["fancyarch", "not supported", "LlamaForCausalLM"],
    "gguf_truncated": ["truncated"],
    "gguf_corrupt": ["cannot read GGUF file"],
    "not_a_model_file": ["neither a GGUF file nor a model folder"],
}


@pytest.mark.parametrize("kind", list(CASES))
def test_llm_raises_one_clear_value_error(kind, good, tmp_path):
    path = make_bad(kind, good, tmp_path)
    with pytest.raises(ValueError) as err:
        LLM(path, kv_cache_memory=2 << 20, max_model_len=128)
    msg = str(err.value)
    assert "\n" not in msg
    for word in CASES[kind]:
        assert word in msg, (word, msg)


# Each kind's message is checked in-process above; `serve` differs between kinds only by where the error is
# raised: in the front end (CoreClient's create_engine_config, before any engine core starts: a missing path,
# a hub id, a folder, an unsupported architecture, every unreadable GGUF file) or in the engine core process
# while it loads the weights (a shape mismatch, a damaged safetensors file), its ValueError sent back to the
# front end. One run per stage, and one GGUF file (read by its own reader in the front end).
@pytest.mark.parametrize("kind", ["unsupported_architecture", "gguf_truncated", "shape_mismatch"])
def test_serve_prints_one_line_and_exits_1(kind, good, tmp_path):
    path = make_bad(kind, good, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", path, "--port", str(free_port()),
                        "--max-model-len", "128", "--kv-cache-memory", "2MiB"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("pagedllm serve: error: "), p.stderr
    for word in CASES[kind]:
        assert word in errors[0], (word, errors[0])
