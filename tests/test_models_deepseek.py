"""DeepSeek-V2 / V3, GLM-4.7-Flash and MiniCPM3 (multi-head latent attention): fp32 greedy ids equal
transformers' on tiny random checkpoints in both attention backends, through batching, chunked
prefill, preemption, prefix caching and TP=2; the KV cache holds the latent once (one plane of
kv_lora_rank + qk_rope_head_dim channels, one KV head)."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import assert_pool_empty, build_tokenizer, pagedllm_logs, record_schedule
from pagedllm import LLM, SamplingParams
from pagedllm.models.deepseek_v2 import DeepseekV2MoeBlock, deepseek_v2_topk
from test_correctness import make_prompts, reference
from test_tensor_parallel import KV_BYTES, wait_gone, worker_pids

_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, mscale=0.707,
             mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
CONFIGS = {
    # V2-Lite's layout: q_proj (no q LoRA), softmax router, greedy top-2, scaled; interleaved RoPE. V2
    # reads neither norm_topk_prob nor rope_interleave (transformers does not): set, they change nothing.
    "v2_lite": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5, first_k_dense_replace=1,
                     norm_topk_prob=True, rope_interleave=False)),
    # V2: q LoRA, group-limited routing (2 of 4 groups), YaRN with mscale (the softmax scale grows by mscale^2).
    "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
           dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0,
                first_k_dense_replace=1, rope_parameters=_YARN)),
    # V3: sigmoid router with correction bias, 2 of 4 groups, renormalized then scaled; interleaved RoPE.
    "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
           dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                first_k_dense_replace=1)),
    # V3 without interleaving, with attention biases and YaRN (Kimi K2's router: one group).
    "v3_plain_rope": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                      dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False, attention_bias=True,
                           norm_topk_prob=True, routed_scaling_factor=1.8, first_k_dense_replace=1,
                           rope_parameters=dict(_YARN, factor=8.0, mscale=1.0, mscale_all_dim=1.0))),
    # GLM-4.7-Flash: V3's attention and router, dense and sparse layers from mlp_layer_types.
    "glm4_moe_lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM,
                      dict(q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
                           mlp_layer_types=["sparse", "dense", "sparse"])),
    # MiniCPM3: dense MLPs, rotate-half RoPE (LongRoPE's short factors), embedding, residual and logit scalings.
    "minicpm3": (transformers.MiniCPM3Config, transformers.MiniCPM3ForCausalLM,
                 dict(q_lora_rank=24, scale_emb=12, scale_depth=1.4, dim_model_base=32,
                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5, 2.0, 4.0],
                                           long_factor=[2.0, 3.0, 5.0, 8.0], original_max_position_embeddings=1024))),
}
LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim: one cached KV head


def build_checkpoint(out_dir: str, arch: str, seed: int = 0) -> str:
    cfg_cls, model_cls, extra = CONFIGS[arch]
    tok = build_tokenizer(out_dir)
    moe = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
    if cfg_cls is transformers.MiniCPM3Config:
        moe = {}
    config = cfg_cls(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                     num_hidden_layers=3, intermediate_size=96, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                     v_head_dim=12, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, initializer_range=0.15,
                     tie_word_embeddings=False, **moe, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # what transformers initializes to 0 or 1 made random, so that each matters
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith(("e_score_correction_bias", "_proj.bias", "_proj_with_mqa.bias")):
                p.normal_(0, 0.3)
            elif name.endswith("layernorm.weight"):
                p.normal_(1, 0.3)
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=list(CONFIGS))
def ds_dir(request, tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param,
                            seed=list(CONFIGS).index(request.param))


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp("v2_b")), "v2", seed=7)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_matches_transformers(ds_dir, backend, monkeypatch):
    vocab = transformers.AutoConfig.from_pretrained(ds_dir).vocab_size
    prompts = make_prompts(vocab, [1, 5, 17, 40, 96], seed=3)
    ref = reference(ds_dir, prompts)
    llm = LLM(ds_dir, kv_cache_memory=2 << 20, max_num_batched_tokens=48, attention_backend=backend)
    runner = llm.llm_engine.executor.runner
    # The latent once: one plane, one KV head of kv_lora_rank + qk_rope_head_dim channels, every layer.
    assert all(c.shape[0] == 1 and c.shape[-2:] == (1, LATENT) for c in runner.kv_caches)
    assert runner.bytes_per_block() == 3 * 16 * LATENT * 4
    mc = llm.llm_engine.config.model_config  # what the benchmarks size caches by says the same
    assert (mc.kv_planes, mc.num_kv_heads, mc.head_dim) == (1, 1, LATENT)
    log = record_schedule(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert ids(outs) == [r[0] for r in ref]
    for (_, ref_lps), out in zip(ref, outs):  # (MiniCPM3's logit scaling moves logprobs, not the argmax)
        comp = out.outputs[0]
        assert max(abs(comp.logprobs[i][t].logprob - lp) for i, (t, lp) in enumerate(zip(comp.token_ids, ref_lps))) < 1e-4
    assert max(n for _, _, n, _ in log) <= 48 and sum(n > 1 for rid, _, n, _ in log if rid == outs[-1].request_id) >= 2
    assert_pool_empty(llm)


def test_preemption_prefix_caching_and_int8_cache(v2_dir):
    vocab = transformers.AutoConfig.from_pretrained(v2_dir).vocab_size
    prompts = make_prompts(vocab, [5, 40, 96, 150], seed=5)
    ref = [r[0] for r in reference(v2_dir, prompts, n=30)]
    bytes_per_block = 3 * 16 * LATENT * 4  # layers x block x latent x fp32: one plane
    small = LLM(v2_dir, kv_cache_memory=12 * bytes_per_block, max_model_len=192, enable_prefix_caching=False)
    assert small.llm_engine.config.cache_config.num_blocks == 12
    assert ids(small.generate(prompts, greedy(30), use_tqdm=False)) == ref
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert_pool_empty(small)

    shared = prompts[3][:100]
    cached_prompts = [shared + p[:7] for p in prompts]
    cached_ref = [r[0] for r in reference(v2_dir, cached_prompts, n=8)]
    llm = LLM(v2_dir, kv_cache_memory=2 << 20)
    assert ids(llm.generate(cached_prompts[:1], greedy(8), use_tqdm=False)) == cached_ref[:1]
    outs = llm.generate(cached_prompts, greedy(8), use_tqdm=False)
    assert ids(outs) == cached_ref
    assert all(o.num_cached_tokens == 96 for o in outs)  # 6 full blocks of the shared 100 tokens
    assert_pool_empty(llm)

    # int8 cache: the one plane is quantized as a two-plane cache's K plane would be (same ids).
    import pagedllm.models.deepseek_v2 as ds
    got = {}
    for shared_kv in (True, False):
        real_init = ds.DeepseekV2Attention.__init__

        def init(self, *a, _real=real_init, _shared=shared_kv, **kw):
            _real(self, *a, **kw)
            self.kv_shared = _shared
        ds.DeepseekV2Attention.__init__ = init
        try:
            q8 = LLM(v2_dir, kv_cache_memory=2 << 20, kv_cache_dtype="int8")
        finally:
            ds.DeepseekV2Attention.__init__ = real_init
        assert q8.llm_engine.executor.runner.kv_caches[0].shape[0] == (1 if shared_kv else 2)
        got[shared_kv] = ids(q8.generate(prompts, greedy(10), use_tqdm=False))
        assert_pool_empty(q8)
    assert got[True] == got[False]
    assert sum(a == b for g, r in zip(got[True], ref) for a, b in zip(g, r[:10])) >= 20  # int8 stays close


def test_tp2_matches_transformers(tmp_path):
    d = build_checkpoint(str(tmp_path), "v3", seed=11)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [3, 17, 60], seed=6)
    ref = [r[0] for r in reference(d, prompts, n=8)]
    llm = LLM(d, tensor_parallel_size=2, kv_cache_memory=KV_BYTES)
    pids = worker_pids(llm)
    try:
        attn = llm.llm_engine.executor.driver.runner.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * (16 + 12), 32)  # heads split
        assert attn.kv_a_proj_with_mqa.output_size == LATENT and attn.o_proj.input_size == 2 * 12  # latent whole
        assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == ref
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()
    assert wait_gone(pids, 10) == []


def test_v2_routing_and_refusals():
    """Group-limited greedy keeps experts of the best groups only (a group scores by its best
    expert); weights are the scaled scores; unknown methods are refused."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g) * 3
    w, e = deepseek_v2_topk(logits, 2, "group_limited_greedy", 4, 2, 2.0)
    probs = logits.softmax(-1)
    best_groups = probs.view(64, 4, 2).amax(-1).topk(2, -1).indices
    assert all(set((e[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(64))
    torch.testing.assert_close(w, probs.gather(1, e) * 2.0)
    w, e = deepseek_v2_topk(logits, 3, "greedy", None, None, 1.5)
    assert torch.equal(e.sort(-1).values, probs.topk(3, -1).indices.sort(-1).values)
    torch.testing.assert_close(w, probs.gather(1, e) * 1.5)
    from types import SimpleNamespace
    cfg = SimpleNamespace(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                          n_shared_experts=0, n_group=3, topk_group=2, routed_scaling_factor=1.0,
                          topk_method="group_limited_greedy")
    with pytest.raises(ValueError, match="n_group=3 equal groups"):
        DeepseekV2MoeBlock(cfg, torch.float32)
    cfg.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported"):
        DeepseekV2MoeBlock(cfg, torch.float32)


def test_multi_token_prediction_layer_is_skipped(tmp_path):
    """A V3 checkpoint's MTP layer (index num_hidden_layers) is not loaded and not reported as unused;
    a stray tensor still is."""
    d = build_checkpoint(str(tmp_path), "v3", seed=3)
    path = f"{d}/model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 28, 32)
    tensors["model.stray.weight"] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [9], seed=2)
    with pagedllm_logs() as records:
        llm = LLM(d, kv_cache_memory=2 << 20)
    unused = [r.getMessage() for r in records if "not loaded" in r.getMessage()]
    assert len(unused) == 1 and "stray.weight" in unused[0] and "layers.3" not in unused[0]
    assert ids(llm.generate(prompts, greedy(6), use_tqdm=False)) == [r[0] for r in reference(d, prompts, n=6)]


def test_kimi_k2_config_is_read_as_deepseek_v3(tmp_path):
    """Kimi K2's config.json names remote code (model_type kimi_k2, auto_map): read with transformers'
    DeepseekV3Config, no code run; the model equals the same checkpoint as deepseek_v3."""
    import json
    import shutil
    d = build_checkpoint(str(tmp_path / "v3"), "v3", seed=2)
    kimi = str(tmp_path / "kimi")
    shutil.copytree(d, kimi)
    with open(f"{kimi}/config.json") as f:
        cfg = json.load(f)
    cfg["model_type"] = "kimi_k2"
    cfg["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    with open(f"{kimi}/config.json", "w") as f:
        json.dump(cfg, f)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [7, 30], seed=4)
    llm = LLM(kimi, kv_cache_memory=1 << 20)
    assert type(llm.llm_engine.config.model_config.hf_config) is transformers.DeepseekV3Config
    assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == [r[0] for r in reference(d, prompts, n=8)]


def test_int8_weights(v2_dir):
    """--quantization int8 quantizes MLA's linear layers (SmoothQuant folds into Llama-style layers only,
    and skips these); output stays close to the float model's."""
    vocab = transformers.AutoConfig.from_pretrained(v2_dir).vocab_size
    prompts = make_prompts(vocab, [5, 40, 96], seed=12)
    ref = [r[0] for r in reference(v2_dir, prompts, n=6)]
    llm = LLM(v2_dir, kv_cache_memory=1 << 20, quantization="int8")
    assert llm.llm_engine.executor.runner.model.quantization_report.num_quantized >= 3 * 5  # q/kv_a/q_b|q/o + MLPs
    got = ids(llm.generate(prompts, greedy(6), use_tqdm=False))
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= 2
    assert_pool_empty(llm)
