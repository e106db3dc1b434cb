"""The bundled demo model (pagedllm/assets/shakespeare-llama): a standard Hugging Face folder
that transformers loads unchanged, the default of LLM(), and pagedllm's greedy output on it
equals transformers'."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.config import DEMO_MODEL_PATH
from test_correctness import hf_greedy

PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
           "KING RICHARD III:\nNow is the winter of our discontent", "O", "\n"]


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(kv_cache_memory=16 << 20)  # no model named: the bundled one


def test_folder_is_complete_and_small():
    files = set(os.listdir(DEMO_MODEL_PATH))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md", "loss_curve.png"} <= files
    size = sum(os.path.getsize(os.path.join(DEMO_MODEL_PATH, f)) for f in files)
    assert size < 20 * 2**20
    cfg = transformers.AutoConfig.from_pretrained(DEMO_MODEL_PATH)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_key_value_heads < cfg.num_attention_heads and cfg.vocab_size <= 4096


def test_greedy_equals_transformers(demo_llm):
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, dtype=torch.float32).eval()
    outs = demo_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 24)[0]
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert_pool_empty(demo_llm)


def test_chat_through_template_returns_clean_text(demo_llm):
    out = demo_llm.chat([{"role": "user", "content": "What news from Verona?"}],
                        SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"]), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert text.strip() and "\ufffd" not in text
    assert text.isprintable() or "\n" in text
    assert out.prompt_token_ids[0] == demo_llm.get_tokenizer().bos_token_id
    assert_pool_empty(demo_llm)
