"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5, ERNIE 4.5 MoE): the
grouped expert computation equals a naive per-token reference, TP shards of the experts sum to the
whole, and fp32 greedy ids equal transformers' through batching, chunked prefill, preemption, prefix
caching and TP=2."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_tokenizer, record_schedule
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import set_tp_state
from pagedllm.layers import fused_moe
from pagedllm.layers.fused_moe import FusedMoE, SparseMoeBlock, fused_experts, select_experts
from test_correctness import make_prompts, reference
from test_tensor_parallel import KV_BYTES, wait_gone, worker_pids

MOE_CONFIGS = {
    # 8 experts, top-2, renormalized over the top-k; 3 layers.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, num_hidden_layers=3)),
    # 6 experts, top-2, no renormalization, a shared expert; layer 1 dense (mlp_only_layers).
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                       shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1],
                       num_hidden_layers=3)),
    # OLMoE: whole-projection q/k norms, q/k/v clipped to 1.0 (the norms make |q| ~ 1: some are);
    # 8 experts, top-2, not renormalized.
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(num_experts=8, num_experts_per_tok=2, intermediate_size=48, clip_qkv=1.0, norm_topk_prob=False,
                   num_hidden_layers=3)),
    # GLM-4.5: layer 0 dense, then DeepSeek-V3 routing (sigmoid, correction bias, 2 of 4 groups, top-3,
    # renormalized, scaled by 1.5) with a shared expert; per-head q/k norms, half-width RoPE, q/k/v biases.
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                 dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, intermediate_size=96,
                      n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                      routed_scaling_factor=1.5, use_qk_norm=True, attention_bias=True, head_dim=16,
                      num_hidden_layers=3)),
    # ERNIE 4.5 MoE: layer 0 dense, then 6 experts chosen on softmax + correction bias, top-2, a shared
    # expert; interleaved RoPE.
    "ernie4_5_moe": (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM,
                     dict(moe_num_experts=6, moe_k=2, moe_intermediate_size=48, intermediate_size=96,
                          moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2,
                          moe_layer_interval=1, num_hidden_layers=3, use_bias=True)),  # biases, the LM head's too
    # 8 experts, top-3, renormalized; every second layer sparse (decoder_sparse_step=2).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, intermediate_size=96,
                       norm_topk_prob=True, decoder_sparse_step=2, head_dim=16, num_hidden_layers=3)),
}


def build_moe_checkpoint(out_dir: str, arch: str, seed: int = 0) -> str:
    cfg_cls, model_cls, extra = MOE_CONFIGS[arch]
    tok = build_tokenizer(out_dir)
    config = cfg_cls(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, initializer_range=0.15, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # transformers zero-initializes some routers: random ones make routing matter
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
        # GLM-4.5's and ERNIE's correction biases (a buffer, a parameter): choosing differs from weighting;
        # biases (transformers zero-initializes them) that matter
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias") or name.endswith(("_proj.bias", "lm_head.bias")):
                b.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def moe_dir(request, tmp_path_factory):
    return build_moe_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param,
                                seed=list(MOE_CONFIGS).index(request.param))


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    return build_moe_checkpoint(str(tmp_path_factory.mktemp("qwen2_moe_b")), "qwen2_moe", seed=7)


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- the layer ------------------------------------------------------------------------------
def naive_moe(x, w13, w2, router_logits, top_k, renormalize):
    """One token at a time, one expert at a time: the definition."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router_logits[t].double(), -1)
        top = probs.topk(top_k)
        weights = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(weights, top.indices):
            h = w13[e].double() @ x[t].double()
            out[t] += (w * (w2[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))).to(x.dtype)
    return out


def _grouped_mm_on_cpu() -> bool:
    try:
        fused_moe._GROUPED_MM(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except Exception:  # noqa: BLE001 - torch without the op or without its CPU kernel
        return False


@pytest.mark.parametrize("renormalize,impl", [
    (True, "loop"), (False, "loop"),
    pytest.param(True, "grouped", marks=pytest.mark.skipif(
        fused_moe._GROUPED_MM is None or not _grouped_mm_on_cpu(), reason="this torch has no CPU grouped_mm")),
])
def test_fused_experts_match_per_token_reference(renormalize, impl):
    g = torch.Generator().manual_seed(0)
    n, hidden, inter, experts, top_k = 37, 16, 12, 8, 3
    x = torch.randn(n, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / 4
    w2 = torch.randn(experts, hidden, inter, generator=g) / 4
    logits = torch.randn(n, experts, generator=g)
    logits[:, 5] = -1e4  # expert 5 gets no token: skipped, output still complete
    weights, chosen = select_experts(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and chosen.shape == (n, top_k) and not (chosen == 5).any()
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(n))
    assert not fused_moe.grouped_mm_supported(x, w13, w2)  # fp32 on CPU: the loop by default
    got = fused_experts(x, w13, w2, weights, chosen, impl=impl)
    torch.testing.assert_close(got, naive_moe(x, w13, w2, logits, top_k, renormalize), rtol=1e-5, atol=1e-5)
    assert fused_experts(x[:0], w13, w2, weights[:0], chosen[:0], impl=impl).shape == (0, hidden)


def test_expert_tp_shards_sum_to_the_whole():
    """Two ranks each load their intermediate slice of every expert from the full per-expert
    tensors; their partial outputs add up to the single-rank output."""
    g = torch.Generator().manual_seed(1)
    hidden, inter, experts = 16, 12, 4
    full = {(e, k): torch.randn(*(hidden, inter) if k == "w2" else (inter, hidden), generator=g)
            for e in range(experts) for k in ("w1", "w2", "w3")}
    x = torch.randn(9, hidden, generator=g)
    logits = torch.randn(9, experts, generator=g)

    def build(rank: int, size: int) -> FusedMoE:
        set_tp_state(rank, size)
        try:
            moe = FusedMoE(experts, 2, hidden, inter, renormalize=True, dtype=torch.float32, reduce_results=False)
        finally:
            set_tp_state(0, 1)
        for (e, k), w in full.items():
            param = moe.w2.weight if k == "w2" else moe.w13.weight
            param.weight_loader(param, w, (e, k))
        return moe

    whole = build(0, 1)(x, logits)
    parts = [build(r, 2) for r in range(2)]
    assert parts[0].w13.weight.shape == (experts, inter, hidden) and parts[0].w2.weight.shape == (experts, hidden, 6)
    torch.testing.assert_close(parts[0](x, logits) + parts[1](x, logits), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shape mismatch"):
        parts[0].w2.weight.weight_loader(parts[0].w2.weight, torch.zeros(hidden, inter + 2), (0, "w2"))
    set_tp_state(0, 3)
    try:
        with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 3"):
            SparseMoeBlock(hidden, experts, 2, 10, True, torch.float32)
    finally:
        set_tp_state(0, 1)


# ---- the models -----------------------------------------------------------------------------
def test_greedy_matches_transformers_batch_and_chunked_prefill(moe_dir, monkeypatch):
    vocab = transformers.AutoConfig.from_pretrained(moe_dir).vocab_size
    prompts = make_prompts(vocab, [1, 5, 17, 40, 96, 150], seed=3)
    ref = [r[0] for r in reference(moe_dir, prompts)]
    llm = LLM(moe_dir, kv_cache_memory=4 << 20, max_num_batched_tokens=48)
    log = record_schedule(llm, monkeypatch)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert ids(outs) == ref
    chunks = [n for rid, done, n, prompt in log if rid == outs[-1].request_id and n > 1 and done + n <= prompt]
    assert len(chunks) >= 3 and max(chunks) <= 48  # the 150-token prompt in chunks
    assert_pool_empty(llm)


def test_preemption_and_prefix_caching(qwen2_moe_dir):
    vocab = transformers.AutoConfig.from_pretrained(qwen2_moe_dir).vocab_size
    prompts = make_prompts(vocab, [5, 40, 96, 150], seed=5)
    ref = [r[0] for r in reference(qwen2_moe_dir, prompts, n=30)]
    bytes_per_block = 2 * 3 * 16 * 2 * 16 * 4  # K+V x layers x block x kv heads x head_dim x fp32
    small = LLM(qwen2_moe_dir, kv_cache_memory=12 * bytes_per_block, max_model_len=192, enable_prefix_caching=False)
    assert small.llm_engine.config.cache_config.num_blocks == 12
    assert ids(small.generate(prompts, greedy(30), use_tqdm=False)) == ref
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert_pool_empty(small)

    shared = prompts[3][:100]
    cached_prompts = [shared + p[:7] for p in prompts]
    cached_ref = [r[0] for r in reference(qwen2_moe_dir, cached_prompts, n=8)]
    llm = LLM(qwen2_moe_dir, kv_cache_memory=4 << 20)
    assert ids(llm.generate(cached_prompts[:1], greedy(8), use_tqdm=False)) == cached_ref[:1]
    outs = llm.generate(cached_prompts, greedy(8), use_tqdm=False)
    assert ids(outs) == cached_ref
    assert all(o.num_cached_tokens == 96 for o in outs)  # 6 full blocks of the shared 100 tokens
    assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe"])
def test_tp2_matches_transformers(arch, tmp_path):
    d = build_moe_checkpoint(str(tmp_path), arch, seed=11)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [3, 17, 60], seed=6)
    ref = [r[0] for r in reference(d, prompts, n=8)]
    llm = LLM(d, tensor_parallel_size=2, kv_cache_memory=KV_BYTES)
    pids = worker_pids(llm)
    try:
        runner = llm.llm_engine.executor.driver.runner
        experts = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
        assert experts.intermediate_size_per_rank == MOE_CONFIGS[arch][2].get(
            "moe_intermediate_size", MOE_CONFIGS[arch][2]["intermediate_size"]) // 2
        assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == ref
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()
    assert wait_gone(pids, 10) == []


def test_dummy_bfloat16_then_missing_or_misshapen_expert_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file
    d = build_moe_checkpoint(str(tmp_path), "qwen3_moe", seed=3)
    llm = LLM(d, load_format="dummy", dtype="bfloat16", kv_cache_memory=1 << 20)
    experts = next(m for m in llm.llm_engine.executor.runner.model.modules() if isinstance(m, FusedMoE))
    assert experts.w13.weight.dtype == torch.bfloat16 and experts.w13.weight.abs().max() > 0  # dummy-filled
    assert len(llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert_pool_empty(llm)
    path = f"{d}/model.safetensors"
    tensors = load_file(path)
    up = tensors.pop("model.layers.1.mlp.experts.2.up_proj.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing expert weights .*: \['layers.1.mlp.experts.2.w3'\]"):
        LLM(d, kv_cache_memory=1 << 20)
    tensors["model.layers.1.mlp.experts.2.up_proj.weight"] = up[:47]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"shape mismatch for expert 2 w3: expected \(48, 64\), got \(47, 64\)"):
        LLM(d, kv_cache_memory=1 << 20)


def test_glm4_moe_groups_of_one_expert_are_refused():
    """A group scores by its two best experts: n_group = n_routed_experts is refused at build (transformers
    fails in its first forward)."""
    from types import SimpleNamespace

    from pagedllm.models.glm4_moe import Glm4MoeBlock
    cfg = SimpleNamespace(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                          n_shared_experts=0, n_group=8, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="groups of at least 2 experts"):
        Glm4MoeBlock(cfg, torch.float32)
    cfg.n_group = 4
    assert Glm4MoeBlock(cfg, torch.float32).num_groups == 4
