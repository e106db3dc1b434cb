"""``pagedllm bench perplexity`` (benchmarks/perplexity.py): llama-perplexity's windows and scoring,
checked against a direct transformers computation on a tiny random Llama (no llama.cpp needed)."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from conftest import build_checkpoint, corpus
from pagedllm.benchmarks import perplexity as bp


def test_llama_windows_cut_and_bos():
    ids = list(range(100, 135))  # 35 tokens: 4 windows of 8, the tail of 3 dropped
    w = bp.llama_windows(ids, 8, bos=1)
    assert len(w) == 4
    assert w[1] == [1] + list(range(109, 116))
    assert ids[8] == 108  # the caller's list is not changed
    assert bp.llama_windows(ids, 8, bos=None, chunks=2) == [list(range(100, 108)), list(range(108, 116))]
    with pytest.raises(ValueError, match="fewer than one window"):
        bp.llama_windows(ids, 64, bos=None)


def test_llama_perplexity_formula():
    nlls = [1.0, 2.0, 3.0, 2.0]
    ppl, err = bp.llama_perplexity(nlls)
    assert ppl == pytest.approx(math.exp(2.0))
    # llama.cpp: sqrt((mean(x^2) - mean^2) / (count - 1)) * ppl
    assert err == pytest.approx(math.sqrt((18 / 4 - 4) / 3) * math.exp(2.0))


def test_gguf_add_bos_key(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "keys.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert bp.gguf_add_bos(path) is True
    assert bp.gguf_add_bos(str(tmp_path)) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    model = build_checkpoint(str(root / "hf"), "llama", seed=5)
    text = root / "text.txt"
    text.write_text(corpus(3000, seed=9))
    return model, str(text), str(root / "out")


def test_bench_equals_direct_torch(tiny):
    """The bench's PPL on a HF folder equals exp(mean NLL) of the second half of each BOS-led window
    computed with transformers in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, text, out = tiny
    p = argparse.ArgumentParser()
    bp.add_args(p)
    a = p.parse_args(["--model", model, "--text", text, "--ctx", "64", "--chunks", "3", "--add-bos", "yes",
                      "--output-dir", out])
    res = a.func(a)
    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok.bos_token_id] + tok.encode(open(text).read(), add_special_tokens=False)
    assert res["tokens"] == len(ids) and res["windows"] == 3 and res["add_bos"] is True
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    nlls = []
    for i in range(3):
        w = torch.tensor([tok.bos_token_id] + ids[i * 64 + 1:(i + 1) * 64])
        with torch.no_grad():
            logp = torch.log_softmax(hf(w[None]).logits[0].float(), -1)
        nlls += [-logp[pos - 1, w[pos]].item() for pos in range(33, 64)]  # first = 32: tokens 33..63 scored
    ppl, err = bp.llama_perplexity(nlls)
    run = res["runs"]["auto"]
    assert run["scored_tokens"] == len(nlls) == 3 * 31
    assert run["perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert run["plus_minus"] == pytest.approx(err, rel=1e-2)


def test_bench_refuses_missing_text(tiny, tmp_path):
    p = argparse.ArgumentParser()
    bp.add_args(p)
    a = p.parse_args(["--model", tiny[0], "--text", str(tmp_path / "none.txt")])
    with pytest.raises(SystemExit, match="no text file"):
        a.func(a)
