"""Llama 4 text models: NoPE layers with attention temperature, RoPE layers (interleaved) with
q/k RMS norms after RoPE, MoE layers whose sigmoid router weights scale the experts' input plus a
shared expert, dense layers between. fp32 greedy ids equal transformers' with chunked prefill and
at TP=2, with the RoPE layers' chunked attention across chunks; the image-text checkpoint serves its
language model."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_tokenizer
from pagedllm import LLM, SamplingParams
from test_correctness import make_prompts, reference
from test_tensor_parallel import KV_BYTES, wait_gone, worker_pids


def text_config(tok, **extra) -> transformers.Llama4TextConfig:
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id, initializer_range=0.15, tie_word_embeddings=False,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=256,
              floor_scale=4, attn_scale=0.5, no_rope_layers=[1, 1, 1, 0])  # floor_scale 4: the temperature acts
    return transformers.Llama4TextConfig(**{**kw, **extra})


def randomize(model) -> None:
    with torch.no_grad():  # routing and experts that matter
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0, 0.5)
            elif "experts.gate_up_proj" in name or "experts.down_proj" in name:
                p.normal_(0, 0.15)


def build_llama4(out_dir: str, seed: int = 0, **extra) -> str:
    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(text_config(tok, **extra)).eval()
    randomize(model)
    model.save_pretrained(out_dir)
    return out_dir


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("extra", [{}, dict(num_experts_per_tok=2, interleave_moe_layer_step=1, use_qk_norm=False),
                                   dict(attention_chunk_size=16)])  # prompts and outputs across chunks
def test_greedy_matches_transformers(tmp_path, extra):
    d = build_llama4(str(tmp_path), **extra)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [1, 17, 60], seed=4)
    ref = [r[0] for r in reference(d, prompts, n=10)]
    for backend in ("auto", "torch"):
        llm = LLM(d, kv_cache_memory=1 << 22, max_model_len=256, max_num_batched_tokens=24, attention_backend=backend)
        assert ids(llm.generate(prompts, greedy(10), use_tqdm=False)) == ref
        assert_pool_empty(llm)


def test_tp2_and_the_image_text_checkpoint(tmp_path):
    tok = build_tokenizer(str(tmp_path))
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=text_config(tok).to_dict(), vision_config=vision)
    torch.manual_seed(2)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(str(tmp_path))
    prompts = make_prompts(len(tok), [3, 40], seed=5)
    with torch.no_grad():  # the oracle: the checkpoint's own language model (a Llama4ForCausalLM), uncached
        ref = []
        for p in prompts:
            seq = list(p)
            for _ in range(8):
                seq.append(int(model.language_model(torch.tensor([seq])).logits[0, -1].argmax()))
            ref.append(seq[len(p):])
    llm = LLM(str(tmp_path), tensor_parallel_size=2, kv_cache_memory=KV_BYTES, max_model_len=256)
    pids = worker_pids(llm)
    try:
        assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == ref
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()
    assert wait_gone(pids, 10) == []
