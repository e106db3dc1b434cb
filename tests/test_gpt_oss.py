"""gpt-oss: attention sinks, alternating sliding-window and global layers, YaRN, biased clamped-SwiGLU
experts under a biased top-k router. fp32 greedy ids equal transformers' on a random checkpoint
(prompts past the window, chunked prefill, preemption, prefix caching, both attention backends),
and an MXFP4 checkpoint (OpenAI's expert format) loads to the same weights transformers dequantizes,
also at TP=2."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import assert_pool_empty, build_tokenizer
from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import mxfp4
from pagedllm.models.gpt_oss import GptOssExperts, clamped_swiglu
from test_correctness import make_prompts, reference
from test_tensor_parallel import KV_BYTES, wait_gone, worker_pids

WINDOW = 8


def build_gpt_oss(out_dir: str, seed: int = 0, max_position_embeddings: int = 256) -> str:
    tok = build_tokenizer(out_dir)
    config = transformers.GptOssConfig(
        vocab_size=len(tok), hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=WINDOW, max_position_embeddings=max_position_embeddings, initializer_range=0.15,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": max_position_embeddings / 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # sinks, router and biases large enough to matter; some gates past the clamp
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.weight", "router.bias")):
                p.normal_(0, 1.0)
            elif name.endswith("_bias"):
                p.normal_(0, 0.3)
            elif name.endswith("experts.gate_up_proj"):
                p.normal_(0, 0.6)
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return build_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_clamped_swiglu_is_transformers_gate():
    """Our [gate | up] halves against transformers' interleaved columns: the same numbers."""
    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=5, num_local_experts=1)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg)
    gate_up = torch.randn(7, 10) * 6  # past the limit of 7 on both sides
    want = experts._apply_gate(gate_up)
    got = clamped_swiglu(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1), cfg.swiglu_alpha, cfg.swiglu_limit)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_experts_with_biases_match_per_token_definition(impl):
    from pagedllm.layers import fused_moe
    from test_models_moe import _grouped_mm_on_cpu
    if impl == "grouped" and (fused_moe._GROUPED_MM is None or not _grouped_mm_on_cpu()):
        pytest.skip("this torch has no CPU grouped_mm")
    g = torch.Generator().manual_seed(0)
    n, hidden, inter, experts, k = 29, 16, 8, 6, 2
    x, w13 = torch.randn(n, hidden, generator=g), torch.randn(experts, 2 * inter, hidden, generator=g)
    w2, b13 = torch.randn(experts, hidden, inter, generator=g) / 3, torch.randn(experts, 2 * inter, generator=g)
    b2 = torch.randn(experts, hidden, generator=g)
    weights = torch.rand(n, k, generator=g)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    act = lambda gu: clamped_swiglu(gu, 1.702, 7.0)  # noqa: E731
    got = fused_moe.fused_experts(x, w13, w2, weights, chosen, impl=impl, w13_bias=b13, w2_bias=b2, activation=act)
    want = torch.stack([sum(weights[t, j] * (w2[e] @ act((w13[e] @ x[t] + b13[e])[None])[0] + b2[e])
                            for j, e in enumerate(chosen[t].tolist())) for t in range(n)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_greedy_matches_transformers(gpt_oss_dir, monkeypatch):
    vocab = transformers.AutoConfig.from_pretrained(gpt_oss_dir).vocab_size
    prompts = make_prompts(vocab, [1, 5, 17, 40, 96], seed=3)
    ref = [r[0] for r in reference(gpt_oss_dir, prompts, n=12)]
    for backend in ("auto", "torch"):
        llm = LLM(gpt_oss_dir, kv_cache_memory=4 << 20, max_num_batched_tokens=32, attention_backend=backend)
        runner = llm.llm_engine.executor.runner
        attn = runner.model.layers[0].self_attn
        assert attn.sinks.shape == (4,) and attn.sinks.abs().sum() > 0
        assert [type(layer.self_attn.backend).__name__ for layer in runner.model.layers][:2] == \
            ["SlidingWindowBackend", "CpuPagedAttention" if backend == "auto" else "TorchPagedAttention"]
        assert ids(llm.generate(prompts, greedy(), use_tqdm=False)) == ref, backend
        assert_pool_empty(llm)


def test_preemption_and_prefix_caching(gpt_oss_dir):
    vocab = transformers.AutoConfig.from_pretrained(gpt_oss_dir).vocab_size
    prompts = make_prompts(vocab, [30, 60, 90], seed=5)
    prompts = prompts + [prompts[2][:64] + [7, 8, 9]]  # shares 4 full blocks with prompt 2
    # 12 tokens: prompts 3 and 2 are preempted after 5 and 7 output tokens (as with 24), so each recomputes
    # prompt + outputs through the sliding (window 8) and full layers and decodes 5-7 more after it
    ref = [r[0] for r in reference(gpt_oss_dir, prompts, n=12)]
    bytes_per_block = 2 * 4 * 16 * 2 * 16 * 4  # K+V x layers x block x kv heads x head_dim x fp32
    llm = LLM(gpt_oss_dir, kv_cache_memory=14 * bytes_per_block, max_model_len=128)
    assert ids(llm.generate(prompts, greedy(12), use_tqdm=False)) == ref
    assert llm.llm_engine.scheduler.num_preemptions > 0
    out = llm.generate([prompts[3]], greedy(12), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[3] and out.num_cached_tokens == 64
    assert_pool_empty(llm)


def write_mxfp4(src: str, dst: str) -> None:
    """``dst``: ``src`` with every expert matrix in OpenAI's MXFP4 format (blocks and scales, [E, out,
    in/32, 16]); ``src`` gets the dequantized values back, so transformers runs the same weights."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    tensors = load_file(f"{src}/model.safetensors")
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors[name].transpose(1, 2))  # [E, out, in]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        tensors[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2).contiguous()
    save_file(tensors, f"{src}/model.safetensors", metadata={"format": "pt"})
    quantized = {n: t for n, t in tensors.items() if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**quantized, **packed}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    with open(f"{dst}/config.json") as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router"]}
    with open(f"{dst}/config.json", "w") as fh:
        json.dump(cfg, fh)


def test_mxfp4_checkpoint_at_tp2(tmp_path):
    src = build_gpt_oss(str(tmp_path / "bf"), seed=4)
    write_mxfp4(src, str(tmp_path / "mx"))
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    packed = load_file(str(tmp_path / "mx" / "model.safetensors"))
    plain = load_file(f"{src}/model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"  # transformers' own dequantization agrees with ours
    assert torch.equal(convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"],
                                                  dtype=torch.float32), plain[name])
    vocab = transformers.AutoConfig.from_pretrained(src).vocab_size
    prompts = make_prompts(vocab, [3, 17, 60], seed=6)
    ref = [r[0] for r in reference(src, prompts, n=8)]
    llm = LLM(str(tmp_path / "mx"), tensor_parallel_size=2, kv_cache_memory=KV_BYTES)
    pids = worker_pids(llm)
    try:
        experts = next(m for m in llm.llm_engine.executor.driver.runner.model.modules()
                       if isinstance(m, GptOssExperts))
        assert experts.gate_up_proj.shape == (8, 32, 64) and experts.down_proj.shape == (8, 64, 16)
        assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == ref
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()
    assert wait_gone(pids, 10) == []


def test_missing_mxfp4_scales_is_a_clear_error(tmp_path):
    src = build_gpt_oss(str(tmp_path / "bf"), seed=2)
    write_mxfp4(src, str(tmp_path / "mx"))
    path = str(tmp_path / "mx" / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"MXFP4 tensors without their pair .*layers.2.mlp.experts.down_proj"):
        LLM(str(tmp_path / "mx"), kv_cache_memory=1 << 20)


def write_gpt_oss_gguf(hf_dir: str, out_path: str) -> None:
    """The checkpoint in ``hf_dir`` as llama.cpp's converter writes gpt-oss (``conversion/gpt_oss.py``):
    experts split into gate / up [E, I, H] and down [E, H, I], in MXFP4; the rest F32. ``hf_dir``'s
    expert matrices get the MXFP4-rounded values back, so transformers runs the same weights."""
    import gguf
    import numpy as np
    from test_gguf import add_tokenizer

    cfg = json.load(open(f"{hf_dir}/config.json"))
    rope = cfg["rope_parameters"]
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(out_path, "gpt-oss")
    for add, value in [(w.add_block_count, n), (w.add_context_length, cfg["max_position_embeddings"]),
                       (w.add_embedding_length, cfg["hidden_size"]), (w.add_feed_forward_length, cfg["intermediate_size"]),
                       (w.add_expert_feed_forward_length, cfg["intermediate_size"]),
                       (w.add_head_count, cfg["num_attention_heads"]), (w.add_head_count_kv, cfg["num_key_value_heads"]),
                       (w.add_key_length, cfg["head_dim"]), (w.add_value_length, cfg["head_dim"]),
                       (w.add_rope_freq_base, rope["rope_theta"]), (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
                       (w.add_expert_count, cfg["num_local_experts"]), (w.add_expert_used_count, cfg["num_experts_per_tok"]),
                       (w.add_sliding_window, cfg["sliding_window"])]:
        add(value)
    if rope["rope_type"] == "yarn":  # (llama.cpp's converter writes no scaling keys for plain RoPE)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    add_tokenizer(w, hf_dir, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n)
    tensors = load_file(f"{hf_dir}/model.safetensors")
    mx = gguf.GGMLQuantizationType.MXFP4

    def rounded(a: np.ndarray) -> np.ndarray:  # [..., in] through MXFP4 and back
        return gguf.quants.dequantize(gguf.quants.quantize(a, mx), mx).reshape(a.shape)

    for name, t in sorted(tensors.items()):
        a = t.float().numpy()
        prefix = name.rsplit(".mlp.experts.", 1)[0].replace("model.layers.", "blk.") + "."
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I], gate and up columns interleaved
            rows = rounded(np.ascontiguousarray(a.transpose(0, 2, 1)))  # [E, 2I, H]
            tensors[name] = torch.from_numpy(np.ascontiguousarray(rows.transpose(0, 2, 1)))
            w.add_tensor(prefix + "ffn_gate_exps.weight", gguf.quants.quantize(rows[:, 0::2], mx), raw_dtype=mx)
            w.add_tensor(prefix + "ffn_up_exps.weight", gguf.quants.quantize(rows[:, 1::2], mx), raw_dtype=mx)
        elif name.endswith("experts.down_proj"):  # [E, I, H]
            rows = rounded(np.ascontiguousarray(a.transpose(0, 2, 1)))  # [E, H, I]
            tensors[name] = torch.from_numpy(np.ascontiguousarray(rows.transpose(0, 2, 1)))
            w.add_tensor(prefix + "ffn_down_exps.weight", gguf.quants.quantize(rows, mx), raw_dtype=mx)
        elif name.endswith("experts.gate_up_proj_bias"):
            w.add_tensor(prefix + "ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2]))
            w.add_tensor(prefix + "ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2]))
        elif name.endswith("experts.down_proj_bias"):
            w.add_tensor(prefix + "ffn_down_exps.bias", a)
        else:
            base, suffix = name.rsplit(".", 1)
            w.add_tensor(names.get_name(base if suffix in ("weight", "bias") else name) + "." +
                         (suffix if suffix in ("weight", "bias") else "weight"), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(tensors, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("rope", ["yarn", "default"])
def test_gguf_mxfp4_matches_transformers(tmp_path, rope):
    """A gpt-oss GGUF as llama.cpp writes it (MXFP4 experts; transformers' GGUF map leaves experts
    and sinks out, misreads the YaRN metadata and takes a file without it for YaRN): fp32 greedy ids
    equal transformers' on the same (MXFP4-rounded) weights."""
    pytest.importorskip("gguf")
    hf = build_gpt_oss(str(tmp_path / "hf"), seed=8)
    if rope == "default":
        cfg = json.load(open(f"{hf}/config.json"))
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 150000.0}
        json.dump(cfg, open(f"{hf}/config.json", "w"))
    path = str(tmp_path / "oss.gguf")
    write_gpt_oss_gguf(hf, path)
    vocab = transformers.AutoConfig.from_pretrained(hf).vocab_size
    prompts = make_prompts(vocab, [3, 17, 40], seed=2)
    ref = [r[0] for r in reference(hf, prompts, n=8)]
    llm = LLM(path, kv_cache_memory=1 << 22)
    cfg = llm.llm_engine.model_config.hf_config
    assert (cfg.head_dim, cfg.sliding_window, cfg.rope_parameters["rope_type"]) == (16, WINDOW, rope)
    assert cfg.rope_parameters.get("truncate", False) is False
    assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == ref
    assert_pool_empty(llm)
