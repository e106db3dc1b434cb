"""``pagedllm bench gguf-decode``'s file writer (benchmarks/gguf_decode.py): the F16 file that
llama-quantize takes, and the block types of the files it decodes itself (no llama.cpp needed)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm.benchmarks import gguf_decode
from pagedllm.benchmarks.model_shapes import SHAPES

gguf = pytest.importorskip("gguf")


def _types(path: str) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_f16_file_for_llama_quantize(tmp_path):
    path = gguf_decode.write_gguf(str(tmp_path / "tiny-F16.gguf"), "llama-tiny", "F16")
    spec = SHAPES["llama-tiny"]
    types = _types(path)
    assert types["blk.0.ffn_gate.weight"] == "F16" and types["output.weight"] == "F16"
    assert types["token_embd.weight"] == "F16" and types["blk.1.attn_norm.weight"] == "F32"
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_gate.weight")
    w = np.asarray(t.data, dtype=np.float32)
    assert w.shape == (spec["intermediate_size"], spec["hidden_size"])
    assert 0.015 < w.std() < 0.025  # normal values of std 0.02, not random bytes


def test_q8_0_file(tmp_path):
    path = gguf_decode.write_gguf(str(tmp_path / "tiny-Q8_0.gguf"), "llama-tiny", "Q8_0")
    types = _types(path)
    assert types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["output.weight"] == "Q8_0"  # hidden 64: no whole Q6_K block a row
