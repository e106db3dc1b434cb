"""Model loading: registry errors, sharded checkpoints, RoPE scalings, tied embeddings, dummy
weights, dtypes, KV budget errors, prompt validation, chat, timing metrics."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_checkpoint
from pagedllm import LLM, SamplingParams
from test_correctness import hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _assert_matches_hf(model_dir: str, **llm_kw) -> LLM:
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = make_prompts(vocab, [3, 30, 70], seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, kv_cache_memory=2 << 20, **llm_kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8)[0] for p in prompts]
    assert_pool_empty(llm)
    return llm


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_scaling_and_tied_embeddings(tmp_path, rope):
    d = build_checkpoint(str(tmp_path), "llama", seed=3, rope_scaling=rope, tie_word_embeddings=True,
                         rope_theta=500000.0)
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["tie_word_embeddings"] is True
    _assert_matches_hf(d)


@pytest.mark.parametrize("extra", [{}, {"truncate": False, "beta_fast": 16, "beta_slow": 2},
                                   {"mscale": 0.707, "mscale_all_dim": 0.707}, {"mscale": 1.0, "mscale_all_dim": 0.5},
                                   {"attention_factor": 0.8}, {"factor": 40.0}])
def test_yarn_frequencies_and_attention_factor_equal_transformers(extra):
    """YaRN's table against transformers' own ``_compute_yarn_parameters``, bit for bit, over its
    options (truncation, betas, DeepSeek's mscale pair, an explicit attention factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from pagedllm.config import get_rope_parameters
    from pagedllm.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq, rope_attention_factor

    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "rope_theta": 1e6, **extra}
    config = transformers.Qwen3Config(hidden_size=128, num_attention_heads=2, head_dim=64,
                                      max_position_embeddings=8192, rope_parameters=dict(rope))
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = get_rope_parameters(config)
    assert torch.equal(compute_inv_freq(64, params), ref_inv_freq)
    assert rope_attention_factor(params) == ref_factor
    table = RotaryEmbedding(64, 300, params, torch.float32).cos_sin_cache  # [positions, 2, 64]
    angles = torch.outer(torch.arange(300).float(), ref_inv_freq).repeat(1, 2)
    assert torch.equal(table[:, 0], angles.cos() * ref_factor)


def test_sharded_checkpoint(tmp_path):
    d = build_checkpoint(str(tmp_path / "full"), "qwen2", seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    for f in os.listdir(d):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(d, f), sharded)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    _assert_matches_hf(sharded)


def test_folder_name_with_glob_characters(tmp_path, llama_dir):
    d = str(tmp_path / "model [v2]*")
    shutil.copytree(llama_dir, d)
    llm = LLM(d, kv_cache_memory=1 << 20)
    assert len(llm.generate(["the king"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_unsupported_architecture_is_named(tmp_path, llama_dir):
    d = str(tmp_path / "gpt")
    shutil.copytree(llama_dir, d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["FancyNewForCausalLM"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*supported.*LlamaForCausalLM"):
        LLM(d, kv_cache_memory=1 << 20)


@pytest.mark.parametrize("arch,window", [("mistral", {"sliding_window": 16}),
                                         ("qwen2", {"sliding_window": 16, "use_sliding_window": True,
                                                    "max_window_layers": 1})])
def test_sliding_windows_match_transformers(tmp_path, arch, window):
    """Mistral's window on every layer; Qwen2's from max_window_layers on (layer 1 of 2): prompts of
    30 and 70 tokens reach past the 16-token window."""
    d = build_checkpoint(str(tmp_path), arch, **window)
    llm = _assert_matches_hf(d)
    model = llm.llm_engine.executor.runner.model
    windows = [getattr(layer.self_attn.backend, "window", None) for layer in model.layers]
    assert windows == ([16, 16] if arch == "mistral" else [None, 16])


def test_dummy_weights_and_bfloat16(llama_dir):
    llm = LLM(llama_dir, load_format="dummy", kv_cache_memory=1 << 20)
    out = llm.generate(["the king"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    llm = LLM(llama_dir, dtype="bfloat16", kv_cache_memory=1 << 20)
    runner = llm.llm_engine.executor.runner
    assert runner.model.embed_tokens.weight.dtype == torch.bfloat16 and runner.kv_caches[0].dtype == torch.bfloat16
    assert len(llm.generate(["the king"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    assert_pool_empty(llm)


def test_kv_budget_too_small_names_the_setting(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_memory|gpu_memory_utilization"):
        LLM(llama_dir, kv_cache_memory=4096)


@pytest.mark.parametrize("kwargs, match", [(dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
                                           (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
                                           (dict(kv_cache_memory="64MiB"), "kv_cache_memory must be a number of bytes")])
def test_zero_or_mistyped_limits_are_refused(llama_dir, kwargs, match):
    """0 is not "the default" (it was, through ``or``), and a size string is a clear ValueError."""
    with pytest.raises(ValueError, match=match):
        LLM(llama_dir, **kwargs)


def test_prompt_validation(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory=1 << 20, max_model_len=64)
    assert llm.llm_engine.model_config.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([list(range(6, 71))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**6]], GREEDY, use_tqdm=False)
    # A prompt near the limit stops at max_model_len with finish_reason "length".
    out = llm.generate([list(range(6, 66))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert_pool_empty(llm)
    default = LLM(llama_dir, kv_cache_memory=1 << 20)
    assert default.llm_engine.model_config.max_model_len == 1024  # from config.json


def test_chat_and_timing_metrics(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory=1 << 20)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 8
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    two = llm.chat([conv, conv[1:]], GREEDY, use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids and len(two) == 2
    assert_pool_empty(llm)


def test_unused_checkpoint_tensors_are_logged(tmp_path):
    """A tensor no parameter takes is named in one log line (weights a model ignores must not go
    unnoticed); a clean checkpoint logs none."""
    from safetensors.torch import load_file, save_file
    from conftest import build_checkpoint, pagedllm_logs
    from pagedllm import LLM
    d = build_checkpoint(str(tmp_path), "llama")
    with pagedllm_logs() as records:
        LLM(d, kv_cache_memory=1 << 20)
        assert not [r for r in records if "not loaded" in r.getMessage()]
        tensors = load_file(f"{d}/model.safetensors")
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
        tensors["lm_head.bias"] = torch.zeros(3)
        save_file(tensors, f"{d}/model.safetensors", metadata={"format": "pt"})
        LLM(d, kv_cache_memory=1 << 20)
    lines = [r.getMessage() for r in records if "not loaded" in r.getMessage()]
    assert len(lines) == 1 and "2 checkpoint tensor(s)" in lines[0], lines
    assert "layers.0.mlp.extra.weight" in lines[0] and "lm_head.bias" in lines[0]
