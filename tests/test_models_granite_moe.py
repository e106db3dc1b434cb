"""IBM Granite MoE families: Granite 3.x MoE (routed experts), Granite MoE Shared (plus a dense shared
MLP) and Granite 4.0 dense (GraniteMoeHybrid whose every layer is attention: the shared MLP, with or
without experts, RoPE or none). Their checkpoints keep experts stacked (input_linear [E, 2I, H],
output_linear [E, H, I]). fp32 greedy ids equal transformers' with chunked prefill and at TP=2; a
hybrid checkpoint with Mamba-2 layers is refused with a clear error."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_tokenizer
from pagedllm import LLM, SamplingParams
from test_correctness import make_prompts, reference
from test_tensor_parallel import KV_BYTES, wait_gone, worker_pids

KINDS = {
    "moe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM,
            dict(num_local_experts=6, num_experts_per_tok=2)),
    "shared": (transformers.GraniteMoeSharedConfig, transformers.GraniteMoeSharedForCausalLM,
               dict(num_local_experts=6, num_experts_per_tok=2, shared_intermediate_size=48)),
    "dense_rope": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                   dict(num_local_experts=0, shared_intermediate_size=48, position_embedding_type="rope",
                        layer_types=["attention"] * 3)),
    "hybrid_nope": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                    dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
                         position_embedding_type=None, layer_types=["attention"] * 3)),
}


def build_granite_moe(out_dir: str, kind: str, seed: int = 0, **extra) -> str:
    cfg_cls, model_cls, kw = KINDS[kind]
    tok = build_tokenizer(out_dir)
    config = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     initializer_range=0.15, tie_word_embeddings=False, embedding_multiplier=2.0,
                     attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=3.0, **{**kw, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # routing that matters
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_matches_transformers(kind, tmp_path):
    d = build_granite_moe(str(tmp_path), kind, seed=list(KINDS).index(kind))
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [1, 17, 60], seed=4)
    ref = [r[0] for r in reference(d, prompts, n=10)]
    llm = LLM(d, kv_cache_memory=1 << 22, max_num_batched_tokens=24)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(10), use_tqdm=False)] == ref
    assert_pool_empty(llm)


def test_tp2_splits_stacked_experts_and_shared_mlp(tmp_path):
    d = build_granite_moe(str(tmp_path), "shared", seed=9)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [3, 30], seed=5)
    ref = [r[0] for r in reference(d, prompts, n=8)]
    llm = LLM(d, tensor_parallel_size=2, kv_cache_memory=KV_BYTES)
    pids = worker_pids(llm)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)] == ref
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()
    assert wait_gone(pids, 10) == []


def test_mamba_layers_are_refused(tmp_path):
    d = build_granite_moe(str(tmp_path), "dense_rope", layer_types=["mamba", "attention", "mamba"])
    with pytest.raises(ValueError, match=r"layers \[0, 2\] are Mamba-2 layers"):
        LLM(d, kv_cache_memory=1 << 20)
