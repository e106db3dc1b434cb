"""OPT, GPT-2, Phi-3, Gemma 1, 2 and 3, Granite, OLMo 2 and 3, EXAONE 4, SmolLM3, StarCoder2, Ministral,
Ministral 3, Seed-OSS, ERNIE 4.5, GLM-4, Cohere 1/2, HunYuan, Phi-2 and GPT-NeoX: fp32 greedy ids equal transformers' on tiny random
checkpoints through batching with chunked prefill, preemption, prefix caching and TP=2.

Each family's checkpoint is built once per module (transformers config with small sizes,
``save_pretrained``) and transformers' greedy ids for it are computed once per prompt set.
Variants cover each family's options: OPT with ``project_in``/``project_out`` and OPT-350m's
post-LayerNorm; GPT-2 with per-layer attention scaling; Phi-3 with LongRoPE factors on both sides
of ``original_max_position_embeddings``; Gemma prompts longer than the sliding window; Granite's
multipliers away from 1; SmolLM3 with a NoPE layer; OLMo 2's norms after each branch; EXAONE 4's hybrid windows; Qwen3
with YaRN; StarCoder2's LayerNorms, biases and window; OLMo 3's windows and RoPE per layer type;
Ministral 3's query scaling; Seed-OSS's q/k/v biases without an o_proj one; ERNIE 4.5's interleaved RoPE; GLM-4's interleaved
partial RoPE, fused gate_up_proj and (0414) norms after each branch; Cohere's parallel block, interleaved
RoPE and logit scale, Cohere 2's sliding and NoPE layers.
"""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_tokenizer, record_schedule
from pagedllm import LLM, SamplingParams
from pagedllm.models.registry import supported_architectures
from test_correctness import hf_greedy

MAX_TOKENS = 16
PROMPT_LENS = [1, 4, 23, 57, 130]
_rng = random.Random(0)
_LONGROPE = {"rope_type": "longrope", "short_factor": [_rng.uniform(1, 3) for _ in range(8)],
             "long_factor": [_rng.uniform(2, 8) for _ in range(8)]}

# name -> (transformers config class name, model class name, config keywords, LLM keywords)
FAMILIES = {
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                 max_position_embeddings=512, init_std=0.15), {}),
    "opt_post_norm": ("OPTConfig", "OPTForCausalLM",
                      dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           do_layer_norm_before=False, word_embed_proj_dim=48, max_position_embeddings=512,
                           init_std=0.15), {}),  # OPT-350m's shape: post-norm and projections
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.15,
                  scale_attn_by_inverse_layer_idx=True), {}),
    # max_model_len 512 > original 32: long factors, as transformers uses for sequences past 32;
    # a 48-token window on every layer.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=32,
                  rope_scaling=_LONGROPE, sliding_window=48, initializer_range=0.15, tie_word_embeddings=False), {}),
    # Half of each head's channels rotate (Phi-4-mini rotates 3/4): RotaryEmbedding's rotary_dim.
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM",
                     dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, partial_rotary_factor=0.5,
                          initializer_range=0.15, tie_word_embeddings=False), {}),
    # Sliding window 16 < most prompts; small caps so soft-capping changes the result; Gemma 2's
    # heads x head_dim (96) differs from hidden_size, as in Gemma 2 9B/27B.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=24, sliding_window=16, query_pre_attn_scalar=20,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, max_position_embeddings=512,
                    initializer_range=0.1), {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1000000.0}},
                    max_position_embeddings=512, initializer_range=0.1), {}),
    # Gemma 1: heads x head_dim (96) differs from hidden_size, as in Gemma 7B.
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24, max_position_embeddings=512, initializer_range=0.2), {}),
    # Granite's four scalars away from 1 (Granite 3 2B: 12, 1/128, 0.22, 8), biases on.
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, embedding_multiplier=4.0, attention_multiplier=0.3,
                     residual_multiplier=0.6, logits_scaling=2.5, attention_bias=True, mlp_bias=True,
                     max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=True), {}),
    # OLMo 2: norms after each branch and over the whole q and k projections.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15), {}),
    # EXAONE 4 hybrid: 3 sliding layers (16-token window, RoPE) then a global NoPE one; OLMo 2's
    # post-norms with per-head q/k norms.
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=16, sliding_window_pattern=4,
                     max_position_embeddings=512, initializer_range=0.15), {}),
    # Qwen3 with YaRN (its long-context setting): factor 4 over an original 64 positions, so both
    # the frequencies' ramp and the attention factor (0.1 ln 4 + 1) act within these prompts.
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 10000.0}), {}),
    # StarCoder2: LayerNorms with biases, a plain GELU-tanh MLP, biases everywhere, a 16-token window.
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=16, max_position_embeddings=512,
                        initializer_range=0.15), {}),
    # SmolLM3's default NoPE pattern: the 4th layer of 4 applies no RoPE.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15), {}),
    # OLMo 3: OLMo 2's layer, 3 sliding layers (16-token window) per global one, and a RoPE per
    # layer type (the global layers' with YaRN over an original 64 positions).
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, sliding_window=16, max_position_embeddings=512, initializer_range=0.15,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                                       "original_max_position_embeddings": 64}}), {}),
    # Ministral 3: YaRN and Llama 4's query scaling past an original 32 positions (beta 0.5, so the
    # factor reaches 1 + 0.5 ln 5 within these prompts).
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM",
                   dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15,
                        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
                                         "rope_theta": 1000000.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}), {}),
    # Ministral (8B-2410): Mistral with layer_types; a 16-token window on every layer.
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=512,
                       initializer_range=0.15), {}),  # (transformers' Ministral needs head_dim set)
    # Seed-OSS: biases on q/k/v (attention_bias) but not on o_proj (attention_out_bias), MLP biases.
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM",
                 dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, mlp_bias=True, max_position_embeddings=512,
                      initializer_range=0.15), {}),
    # ERNIE 4.5: interleaved RoPE (channel pairs 2i, 2i + 1), biases on every linear, tied embeddings.
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM",
                 dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, use_bias=True, max_position_embeddings=512,
                      initializer_range=0.15), {}),
    # GLM-4-9B-Chat's shape: RoPE on half of each head's channels, interleaved; q/k/v biases; a fused
    # gate_up_proj. GLM-4-0414 adds norms after each branch.
    "glm": ("GlmConfig", "GlmForCausalLM",
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15), {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15), {}),
    # Cohere (Command R, Aya Expanse): a parallel block over one weight-only LayerNorm, interleaved
    # RoPE, logits scaled by 0.3 (the real 0.0625 would flatten a tiny model's logits too much to show).
    "cohere": ("CohereConfig", "CohereForCausalLM",
               dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, logit_scale=0.3, max_position_embeddings=512,
                    initializer_range=0.15), {}),
    # Cohere 2 (Command R7B): 3 sliding layers (16-token window, RoPE) per global NoPE one.
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, sliding_window=16, logit_scale=0.3,
                     max_position_embeddings=512, initializer_range=0.15), {}),
    # HunYuan dense: q/k RMSNorms per head after RoPE, NTK-alpha RoPE (a stretched base).
    "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15,
                     rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0,
                                      "rope_theta": 10000.0}), {}),
    # Phi-2: a parallel block over LayerNorms, RoPE on 2/5 of each head's channels, biases everywhere
    # (the LM head's too), a GELU-tanh MLP.
    "phi": ("PhiConfig", "PhiForCausalLM",
            dict(hidden_size=80, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.15,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}),
            {}),
    # GPT-NeoX (Pythia): q/k/v fused head by head, RoPE on a quarter of each head, LayerNorms, a GELU
    # MLP; the parallel residual (the default) and the sequential one.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=512, initializer_range=0.15), {}),
    "gpt_neox_sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=512, initializer_range=0.15, use_parallel_residual=False),
                            {}),
}
# Families whose biases (linears', LayerNorms') are drawn at random rather than left at zero.
RANDOM_BIASES = {"granite", "starcoder2", "seed_oss", "ernie4_5", "glm", "glm4", "phi", "gpt_neox",
                 "gpt_neox_sequential"}
# Families whose norm weights are drawn at random around 1 (HunYuan's q/k norms follow RoPE).
RANDOM_NORMS = {"hunyuan"}
# Which prompts each family runs (Phi-3's long factors only match transformers past position 32).
PROMPTS_FOR = {"phi3": [40, 33, 57, 130]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(d)
    return d


_BUILT: dict = {}


def build(name: str, tokenizer_dir: str, root: str):
    """(checkpoint dir, transformers model) for family ``name``, built once per session."""
    if name not in _BUILT:
        cfg_cls, model_cls, kw, _ = FAMILIES[name]
        d = os.path.join(root, name)
        shutil.copytree(tokenizer_dir, d)
        tok = transformers.AutoTokenizer.from_pretrained(d)
        config = getattr(transformers, cfg_cls)(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
        torch.manual_seed(sum(map(ord, name)))
        model = getattr(transformers, model_cls)(config).eval()
        if name in RANDOM_BIASES:  # transformers zero-initializes biases: random ones show up
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if pname.endswith(".bias"):
                        p.normal_(0, 0.5)
        if name in RANDOM_NORMS:  # norm weights of 1 would commute with RoPE (a rotation)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "layernorm" in pname and pname.endswith(".weight"):
                        p.normal_(1.0, 0.5)
        model.save_pretrained(d)
        _BUILT[name] = (d, model, {})
    return _BUILT[name]


@pytest.fixture(scope="module")
def family(request, tokenizer_dir, tmp_path_factory):
    return (request.param, *build(request.param, tokenizer_dir, str(tmp_path_factory.getbasetemp())))


def prompts_for(name: str, vocab: int, seed: int = 0, lens=None) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(n)] for n in lens or PROMPTS_FOR.get(name, PROMPT_LENS)]


def expected(fam, prompts) -> list[list[int]]:
    _, _, model, cache = fam
    for p in prompts:
        if tuple(p) not in cache:
            cache[tuple(p)] = hf_greedy(model, p, MAX_TOKENS)[0]
    return [cache[tuple(p)] for p in prompts]


def generate(llm: LLM, prompts) -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def make_llm(fam, **kw) -> LLM:
    name, d, _, _ = fam
    return LLM(d, **{**FAMILIES[name][3], **kw})


def bytes_per_block(config, block_size: int = 16) -> int:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * 4


ALL = list(FAMILIES)
# Preemption (recompute of prompt + output) and prefix hits (a prefill resuming after cached blocks) reach a
# family's forward as a prefill that starts past position 0: what every family's chunked-prefill test
# already runs (prompts in 32-token chunks). Their own engine paths differ by how positions and the KV
# cache's windows are kept, so they run on one family of each kind: learned positions (OPT, GPT-2),
# sliding windows on every layer (Gemma 2: with soft-capping; Phi-3: with LongRoPE), and hybrid windows
# with a RoPE per layer type (OLMo 3, Gemma 3). (Llama/Mistral: test_correctness, test_prefix_caching,
# test_sliding_window_blocks.)
PREEMPTION_FAMILIES = ["opt", "gemma2", "olmo3"]
PREFIX_CACHING_FAMILIES = ["gpt2", "phi3", "gemma3"]


@pytest.mark.parametrize("family", ALL, indirect=True)
def test_batch_with_chunked_prefill_matches_transformers(family, monkeypatch):
    name, _, model, _ = family
    prompts = prompts_for(name, model.config.vocab_size)
    llm = make_llm(family, kv_cache_memory=4 << 20, max_num_batched_tokens=32)
    log = record_schedule(llm, monkeypatch)
    outs = generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected(family, prompts)
    longest = outs[max(range(len(prompts)), key=lambda i: len(prompts[i]))].request_id
    assert len([1 for rid, done, n, total in log if rid == longest and done + n <= total]) >= 4  # chunked
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > len(prompts)  # not a degenerate model
    assert_pool_empty(llm)


@pytest.mark.parametrize("family", PREEMPTION_FAMILIES, indirect=True)
def test_preemption_matches_transformers(family):
    name, _, model, _ = family
    prompts = prompts_for(name, model.config.vocab_size, seed=1, lens=[40, 41, 43, 44])
    # 11 blocks of 16 tokens: three prompts start (3 blocks each), then each needs a 4th to decode.
    llm = make_llm(family, kv_cache_memory=11 * bytes_per_block(model.config), max_model_len=176,
                   enable_prefix_caching=False)
    assert llm.llm_engine.config.cache_config.num_blocks == 11
    outs = generate(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected(family, prompts)
    assert_pool_empty(llm)


@pytest.mark.parametrize("family", PREFIX_CACHING_FAMILIES, indirect=True)
def test_prefix_caching_matches_transformers(family):
    name, _, model, _ = family
    rng = random.Random(2)
    shared = [rng.randrange(6, model.config.vocab_size) for _ in range(50)]
    prompts = [shared + [rng.randrange(6, model.config.vocab_size) for _ in range(n)] for n in (3, 20, 7)]
    llm = make_llm(family, kv_cache_memory=4 << 20)
    first = generate(llm, prompts[:1])
    rest = generate(llm, prompts[1:])
    assert [o.num_cached_tokens for o in rest] == [48, 48]  # 3 full blocks of the shared 50 tokens
    assert [o.outputs[0].token_ids for o in first + rest] == expected(family, prompts)
    assert_pool_empty(llm)


@pytest.mark.parametrize("family", ALL, indirect=True)
def test_logprobs_match_transformers(family):
    """Each token's logprob within 1e-4 of transformers' log_softmax of its logits: what greedy ids
    cannot show (Granite's logits_scaling, Gemma's final soft-cap)."""
    name, _, model, _ = family
    prompts = prompts_for(name, model.config.vocab_size, seed=5)[-2:]
    llm = make_llm(family, kv_cache_memory=2 << 20)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for p, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        toks, ref = hf_greedy(model, p, MAX_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == toks
        assert max(abs(comp.logprobs[i][t].logprob - r) for i, (t, r) in enumerate(zip(toks, ref))) < 1e-4
    assert_pool_empty(llm)


@pytest.mark.parametrize("family", ["opt", "gpt2", "phi3", "gemma", "gemma2", "gemma3", "granite", "exaone4",
                                    "smollm3", "starcoder2", "ministral3", "glm4", "cohere2", "gpt_neox"],
                         indirect=True)
def test_tensor_parallel_2_matches_transformers(family):
    name, _, model, _ = family
    prompts = prompts_for(name, model.config.vocab_size, seed=3)[-3:]
    llm = make_llm(family, tensor_parallel_size=2, kv_cache_memory=2 << 20, max_num_batched_tokens=64)
    try:
        outs = generate(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected(family, prompts)
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("family", ["gemma", "gemma3", "granite", "olmo2", "exaone4", "smollm3", "olmo3", "cohere2", "phi",
                                    "phi3", "opt_post_norm",
                                    "gpt2"], indirect=True)
def test_pipeline_parallel_2_matches_transformers(family):
    """Two stages: Gemma's stages pass the residual stream on; the Llama subclasses' stages split
    their layers as Llama's do (a NoPE table, OLMo 2's post-norm stream, Granite's multipliers,
    Phi-3's LongRoPE and window); OPT-350m's shape (projections in and out, post-norm) and GPT-2
    (tied head on the last stage) pass their hidden states."""
    name, _, model, _ = family
    prompts = prompts_for(name, model.config.vocab_size, seed=6)[-3:]
    llm = make_llm(family, pipeline_parallel_size=2, kv_cache_memory=2 << 20, max_num_batched_tokens=64)
    try:
        outs = generate(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected(family, prompts)
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()


def test_phi3_short_factors_within_original_length(tokenizer_dir, tmp_path_factory):
    """max_model_len <= original_max_position_embeddings: short factors, as transformers uses there."""
    d, model, _ = build("phi3", tokenizer_dir, str(tmp_path_factory.getbasetemp()))
    prompts = prompts_for("short", model.config.vocab_size)[:3]  # 1, 4, 23 tokens + 8 new <= 32
    llm = LLM(d, max_model_len=32, kv_cache_memory=1 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 8)[0] for p in prompts]
    assert_pool_empty(llm)


def test_registry_lists_and_imports_on_first_use(monkeypatch):
    from pagedllm.models import registry

    assert {"OPTForCausalLM", "GPT2LMHeadModel", "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Exaone4ForCausalLM",
            "SmolLM3ForCausalLM", "Starcoder2ForCausalLM"} <= \
        set(supported_architectures())
    config = transformers.GPT2Config(architectures=["Nope", "GPT2LMHeadModel"])
    calls: list[str] = []
    real = registry.importlib.import_module
    monkeypatch.setattr(registry.importlib, "import_module", lambda n, *a: calls.append(n) or real(n, *a))
    cls = registry.get_model_class(config, 128)
    assert cls.__name__ == "GPT2LMHeadModel" and calls == ["pagedllm.models.gpt2"]


@pytest.mark.parametrize("name,prefix", [("gpt2", "transformer."), ("opt", "model.")])
def test_hub_checkpoint_names_without_prefix(name, prefix, tokenizer_dir, tmp_path_factory, tmp_path):
    """The original hub files of gpt2 and facebook/opt-* name tensors without ``transformer.`` /
    ``model.``, and old GPT-2 files carry ``attn.bias`` causal-mask buffers."""
    from safetensors.torch import load_file, save_file

    fam = (name, *build(name, tokenizer_dir, str(tmp_path_factory.getbasetemp())))
    d = str(tmp_path / name)
    shutil.copytree(fam[1], d)
    path = os.path.join(d, "model.safetensors")
    tensors = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in load_file(path).items()}
    if name == "gpt2":
        tensors["h.0.attn.bias"] = torch.ones(1, 1, 512, 512).tril()
    save_file(tensors, path, metadata={"format": "pt"})
    prompts = prompts_for(name, fam[2].config.vocab_size, seed=4)[2:4]
    llm = LLM(d, kv_cache_memory=1 << 20)
    assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == expected(fam, prompts)
    assert_pool_empty(llm)


def test_learned_positions_bound_max_model_len(tokenizer_dir, tmp_path_factory):
    d, _, _ = build("gpt2", tokenizer_dir, str(tmp_path_factory.getbasetemp()))
    with pytest.raises(ValueError, match="learns 512 positions; max_model_len=600"):
        LLM(d, max_model_len=600, kv_cache_memory=1 << 20)


def test_cohere_qk_norm_is_refused(tokenizer_dir, tmp_path_factory):
    d, _, _ = build("cohere", tokenizer_dir, str(tmp_path_factory.getbasetemp()))
    config = transformers.AutoConfig.from_pretrained(d)
    config.use_qk_norm = True
    from pagedllm.models.registry import get_model_class
    with pytest.raises(ValueError, match="use_qk_norm=True"):
        get_model_class(config, 512)


def test_olmo2_refuses_tensor_parallel_before_starting(tokenizer_dir, tmp_path_factory):
    d, _, _ = build("olmo2", tokenizer_dir, str(tmp_path_factory.getbasetemp()))
    with pytest.raises(ValueError, match="tensor parallelism is not implemented for Olmo2ForCausalLM"):
        LLM(d, tensor_parallel_size=2, kv_cache_memory=1 << 20)


def assert_text_model_matches(d: str, model, prompts, arch: str) -> None:
    """The image-text checkpoint saved in ``d`` (transformers' ``model``) serves its language model
    ``arch`` for text: greedy ids equal the image-text model's on ``prompts``, every block back."""
    llm = LLM(d, kv_cache_memory=2 << 20)
    assert llm.llm_engine.model_config.architecture == arch
    outs = generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, MAX_TOKENS)[0] for p in prompts]
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > len(prompts)  # not a degenerate model
    assert_pool_empty(llm)


def test_gemma3_image_text_checkpoint_serves_its_text_model(tokenizer_dir, tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration (a SigLIP tower beside the language
    model): text prompts run its language model, equal to transformers' image-text model on text."""
    d = str(tmp_path / "gemma3_mm")
    shutil.copytree(tokenizer_dir, d)
    vocab = len(transformers.AutoTokenizer.from_pretrained(d))
    kw = FAMILIES["gemma3"][2]
    text = transformers.Gemma3TextConfig(vocab_size=vocab, **kw)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       initializer_range=0.1)
    torch.manual_seed(7)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(d)
    prompts = prompts_for("gemma3", vocab, seed=7)[1:4]
    assert_text_model_matches(d, model, prompts, "Gemma3ForCausalLM")


@pytest.mark.parametrize("version", ["Qwen2VL", "Qwen2_5_VL"])
def test_qwen_vl_checkpoint_serves_its_text_model(tokenizer_dir, tmp_path, version):
    """Qwen2-VL / Qwen2.5-VL (vision tower under ``visual.``, M-RoPE, tied embeddings on the outer
    config): text prompts run the Qwen2 language model, equal to transformers' image-text model on text."""
    d = str(tmp_path / version)
    shutil.copytree(tokenizer_dir, d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                initializer_range=0.15,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = (dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0])
              if version == "Qwen2_5_VL" else dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2))
    config = getattr(transformers, f"{version}Config")(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(8)
    model = getattr(transformers, f"{version}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # transformers zero-initializes biases (q/k/v): random ones show up
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(d)
    prompts = prompts_for("qwen2", len(tok), seed=8)[1:4]
    assert_text_model_matches(d, model, prompts, "Qwen2ForCausalLM")


# image-text checkpoint -> (its language model's model_type, the text architecture served)
LLAVA_STYLE = {"mistral3": ("mistral", "MistralForCausalLM"), "ministral3": ("ministral3", "Ministral3ForCausalLM"),
               "llava": ("llama", "LlamaForCausalLM")}


@pytest.mark.parametrize("name", list(LLAVA_STYLE))
def test_llava_style_checkpoint_serves_its_text_model(tokenizer_dir, tmp_path, name):
    """Mistral 3 (Pixtral tower; Mistral Small 3.1's Mistral or Ministral 3's ministral3 language
    model) and LLaVA (CLIP tower, a Llama language model named by its text_config's model_type, its
    own lm_head): text prompts run the language model."""
    d = str(tmp_path / name)
    shutil.copytree(tokenizer_dir, d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model_type, text_arch = LLAVA_STYLE[name]
    text = dict(model_type=model_type, vocab_size=len(tok), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, initializer_range=0.15, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if name == "ministral3":  # its YaRN and Llama 4 query scaling past 16 positions
        text["rope_parameters"] = FAMILIES["ministral3"][2]["rope_parameters"] | {"original_max_position_embeddings": 16}
    if name != "llava":
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
        config = transformers.Mistral3Config(text_config=text, vision_config=vision)
    else:
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
        config = transformers.LlavaConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(9)
    model = getattr(transformers, f"{'Llava' if name == 'llava' else 'Mistral3'}ForConditionalGeneration")(config)
    model.eval().save_pretrained(d)
    prompts = prompts_for("llama", len(tok), seed=9)[1:4]
    assert_text_model_matches(d, model, prompts, text_arch)

