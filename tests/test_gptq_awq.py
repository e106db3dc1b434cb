"""int4 Hugging Face checkpoints (GPTQ, AWQ GEMM, compressed-tensors pack-quantized) through the engine
(layers/quantization/int4_formats.py, q4_repack.py).

Each checkpoint is made here: a tiny random Llama / Qwen2 saved by transformers, its linear layers'
weights quantized to 4 bits per group (symmetric or asymmetric, group 32 / 64 / 128, act order by a
random column order) and packed by the reference packers below, written from the formats' specs
(GPTQ: ``qweight`` [K/8, N] nibbles along the inputs, ``qzeros`` [G, N/8] along the outputs, v1
storing z - 1; AWQ: both along the outputs in AutoAWQ's order [0, 2, 4, 6, 1, 3, 5, 7];
compressed-tensors: ``weight_packed`` [N, K/8] of signed codes + 8, ``weight_zero_point`` [N/8, G]).

Oracle: transformers on the dequantized float weights (w = s * (q - z), in float32, exactly what the
checkpoint means), saved as a float checkpoint. Our dequantized path (the default for models under
loader.GGUF_BLOCKS_MIN_FLOAT_BYTES) equals it token for token in fp32; the kernel path (the threshold
lowered) quantizes activations to int8 per block of 32, so its greedy ids are checked as
tests/test_gguf_blocks.py checks them (within a near-tie of transformers' best, equal where the choice
is clear), and its Q4 blocks against the checkpoint's weights: Q4_0 bit-exact, Q4_1 within half a
float16 ulp of s * z.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_pool_empty, build_checkpoint, greedy_up_to_near_ties, pagedllm_logs
from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import q4_repack
from pagedllm.platforms import ops
from test_correctness import hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a packed int32 holds output 8c + AWQ_ORDER[i]


# ----------------------------------------------------------------------- reference quantizer + packers
def quantize(w: torch.Tensor, group: int, sym: bool, order: "torch.Tensor | None", zmin: int = 0):
    """w float32 [N, K] -> (q uint8 [N, K] codes, s float16 [N, G], z int [N, G], g_idx int [K]).
    Act order: the columns are taken in ``order`` (GPTQ: by its Hessian's diagonal, one order per
    input, so q/k/v share one and gate/up another), group i = the i-th run of ``group`` of them."""
    n, k = w.shape
    group = k if group == -1 else group
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    G = -(-k // group)  # (the last group may be shorter)
    s = torch.empty(n, G)
    z = torch.empty(n, G, dtype=torch.int64)
    for g in range(G):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            s[:, g] = torch.maximum(lo.abs(), hi) / 7.5
            z[:, g] = 8
        else:
            s[:, g] = (hi - lo) / 15
            z[:, g] = torch.round(-lo / s[:, g]).clamp(zmin, 15).long()
    s = s.clamp_min(1e-4).half()
    q = torch.round(w / s.float()[:, g_idx]) + z[:, g_idx]
    return q.clamp(0, 15).to(torch.uint8), s, z, g_idx


def dequantize(q, s, z, g_idx) -> torch.Tensor:
    return s.float()[:, g_idx] * (q.float() - z[:, g_idx].float())


def pack_nibbles(v: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int codes (0..15) -> int32, 8 a word along ``dim``: nibble i of word c holds element 8c + order[i]."""
    v = v.long().movedim(dim, 0)
    v = v.reshape(v.shape[0] // 8, 8, *v.shape[1:])
    out = torch.zeros(v.shape[0], *v.shape[2:], dtype=torch.int64)
    for i in range(8):
        out |= v[:, order[i]] << (4 * i)
    out = torch.from_numpy(out.numpy().astype(np.uint32).view(np.int32))
    return out.movedim(0, dim).contiguous()


def pack_gptq(q, s, z, g_idx, v1: bool) -> dict:
    return {"qweight": pack_nibbles(q.t(), 0), "qzeros": pack_nibbles(z.t() - int(v1), 1),
            "scales": s.t().contiguous(), "g_idx": g_idx.int()}


def pack_awq(q, s, z, g_idx, v1=False) -> dict:
    return {"qweight": pack_nibbles(q.t(), 1, AWQ_ORDER), "qzeros": pack_nibbles(z.t(), 1, AWQ_ORDER),
            "scales": s.t().contiguous()}


def pack_compressed_tensors(q, s, z, g_idx, sym: bool, act_order: bool, scale_dtype) -> dict:
    out = {"weight_packed": pack_nibbles(q, 1), "weight_scale": s.to(scale_dtype),
           "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = pack_nibbles(z, 0)
    if act_order:
        out["weight_g_idx"] = g_idx.int()
    return out


def quant_config(method: str, group: int, sym: bool, act_order: bool, v1: bool = True) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": act_order,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group,
                "actorder": "group" if act_order else None, "dynamic": False}}}}


def write_int4(root: str, arch: str, method: str, group: int, sym: bool, act_order: bool, seed: int = 3,
               v1: bool = True, scale_dtype=torch.float16, shared_order: bool = True,
               lm_head: bool = False, tied: bool = False) -> tuple[str, str, dict]:
    """(quantized checkpoint dir, float oracle dir, {layer: (q, s, z, g_idx)}). ``shared_order``
    False gives every matrix its own act order (the fused layers' parts then differ); ``lm_head``
    quantizes the (untied) LM head too (GPTQModel's ``lm_head: true``); ``tied`` ties the head to a
    float16 embedding (as Qwen2.5's int4 checkpoints)."""
    if arch in ("qwen2_moe", "mixtral"):  # hidden 64: group 32 only
        from test_models_moe import build_moe_checkpoint
        float_dir = build_moe_checkpoint(os.path.join(root, "float"), arch, seed=seed)
    else:
        float_dir = build_checkpoint(os.path.join(root, "float"), arch, seed=seed, hidden_size=128,
                                     intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=tied)
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    if tied:
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].half()
    gen = torch.Generator().manual_seed(seed)
    quant, oracle, parts, orders = {}, dict(tensors), {}, {}
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in LINEARS) and not (lm_head and name == "lm_head.weight"):
            quant[name] = w
            continue
        base = name[:-len(".weight")]
        order = None
        if act_order:  # one order per input: q/k/v share the attention's, gate/up the MLP's
            key = base if not shared_order else base.replace("k_proj", "q_proj").replace("v_proj", "q_proj") \
                .replace("up_proj", "gate_proj")
            order = orders.setdefault(key, torch.randperm(w.shape[1], generator=gen))
        q, s, z, g_idx = quantize(w.float(), group, sym, order, zmin=1 if (method == "gptq" and v1) else 0)
        if method == "compressed-tensors":
            s = s.to(scale_dtype)
        parts[base] = (q, s, z, g_idx)
        oracle[name] = dequantize(q, s, z, g_idx)
        packed = (pack_gptq(q, s, z, g_idx, v1) if method == "gptq" else pack_awq(q, s, z, g_idx) if method == "awq"
                  else pack_compressed_tensors(q, s, z, g_idx, sym, act_order, scale_dtype))
        quant.update({f"{base}.{k}": v for k, v in packed.items()})
    qdir, odir = os.path.join(root, "int4"), os.path.join(root, "oracle")
    for d, ts in ((qdir, quant), (odir, oracle)):
        shutil.copytree(float_dir, d)
        save_file(ts, os.path.join(d, "model.safetensors"))
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config(method, group, sym, act_order, v1)
    if lm_head:
        cfg["quantization_config"]["lm_head"] = True
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return qdir, odir, parts


def _hf(odir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(odir, dtype=torch.float32).eval()


def _block_layers(llm):
    model = llm.llm_engine.executor.runner.model
    return [(n, m) for n, m in model.named_modules() if getattr(m, "gguf_segments", None) is not None]


CASES = [  # (arch, method, group, sym, act order, GPTQ v1)
    ("llama", "gptq", 128, True, False, True),
    ("qwen2", "gptq", 32, False, True, False),
    ("llama", "gptq", 64, False, False, True),
    ("qwen2", "awq", 64, False, False, True),
    ("llama", "awq", 128, False, False, True),
    ("llama", "compressed-tensors", 32, True, True, True),
    ("qwen2", "compressed-tensors", 128, False, False, True),
]


@pytest.mark.parametrize("arch,method,group,sym,act_order,v1", CASES,
                         ids=[f"{c[0]}-{c[1]}-g{c[2]}-{'sym' if c[3] else 'asym'}{'-actorder' if c[4] else ''}"
                              f"{'' if c[5] else '-v2'}" for c in CASES])
def test_int4_checkpoint_equals_transformers(tmp_path, monkeypatch, arch, method, group, sym, act_order, v1):
    """Dequantized path: greedy ids equal transformers' on the dequantized weights, logprobs close.
    Kernel path: the Q4 blocks hold the checkpoint's weights (Q4_0 exactly, Q4_1 within half an
    fp16 ulp of s * z), and the greedy ids agree with transformers up to near-ties."""
    scale_dtype = torch.bfloat16 if (method == "compressed-tensors" and not sym) else torch.float16
    qdir, odir, parts = write_int4(str(tmp_path), arch, method, group, sym, act_order, v1=v1, scale_dtype=scale_dtype)
    hf = _hf(odir)
    with pagedllm_logs() as records:
        llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    line = next(r.getMessage() for r in records if r.getMessage().startswith("int4 checkpoint"))
    assert f"{method} int4" in line and "14 dequantized to float32" in line and "under 1024 MiB" in line, line
    assert not _block_layers(llm)
    prompts = make_prompts(llm.llm_engine.vocab_size, [3, 30, 70], seed=6)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        want_ids, want_lps = hf_greedy(hf, p, 8)
        assert o.outputs[0].token_ids == want_ids
        got_lps = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert np.allclose(got_lps, want_lps, atol=1e-4)
    assert_pool_empty(llm)
    del llm

    # the kernel path: the Q4 blocks on the GGUF kernels
    llm, line = _on_kernels(qdir, monkeypatch, {"Q4_0", "Q4_1"})
    want_type = "Q4_0" if sym else "Q4_1"
    assert f"14 {want_type} in blocks" in line and "MiB in blocks" in line, line
    layers = _block_layers(llm)
    assert len(layers) == 8 and all(m.weight is None for _, m in layers)  # qkv, o, gate_up, down of 2 layers
    assert all((m.gguf_perm is not None) == act_order for _, m in layers)
    for name, m in layers:
        _check_blocks(name, m, parts, sym)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_pool_empty(llm)
    assert greedy_up_to_near_ties(hf, prompts, [o.outputs[0].token_ids for o in outs]) >= 12


def _on_kernels(qdir: str, monkeypatch, types: set):
    """(LLM of ``qdir`` on the kernel path (the size threshold set to 0), its ``int4 checkpoint``
    start-up line); skips where the platform lacks kernels of ``types``."""
    if not types <= ops.gguf_kernel_types()[0]:
        pytest.skip(f"no {sorted(types)} kernels on this platform")
    from pagedllm.models import loader
    monkeypatch.setattr(loader, "GGUF_BLOCKS_MIN_FLOAT_BYTES", 0)
    with pagedllm_logs() as records:
        llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    return llm, next(r.getMessage() for r in records if r.getMessage().startswith("int4 checkpoint"))


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _check_blocks(name, m, parts, sym):
    """The layer's blocks, dequantized by ggml's formulas (gguf.quants when installed, else our twin),
    against the checkpoint's weights of its parts; and its output against x @ W^T."""
    prefix, fused = ("model." + name).rsplit(".", 1)
    want = torch.cat([dequantize(*parts[f"{prefix}.{p}"]) for p in _FUSED[fused]])
    got = torch.cat([_ggml_dequantize(raw, t) for _, t, raw in m.gguf_segments])
    if m.gguf_perm is not None:
        got = torch.empty_like(got).index_copy_(1, m.gguf_perm, got)
    if sym:
        assert torch.equal(got, want), name
    else:
        sz = torch.cat([(parts[f"{prefix}.{p}"][1].float() * parts[f"{prefix}.{p}"][2])[:, parts[f"{prefix}.{p}"][3]]
                        for p in _FUSED[fused]])
        assert torch.all((got - want).abs() <= sz.abs() * 2.0 ** -11 + 1e-12), name
    torch.manual_seed(0)
    x = torch.randn(5, want.shape[1])
    y = m(x).double()
    ref = x.double() @ got.double().t() + (m.bias.double() if m.bias is not None else 0)
    d = x.double().abs().view(5, -1, 32).amax(-1) / 127  # the activations' int8 step per block
    wabs = got.abs().double()
    if m.gguf_perm is not None:
        d = x.double()[:, m.gguf_perm].abs().view(5, -1, 32).amax(-1) / 127
        wabs = wabs[:, m.gguf_perm]
    tol = (d / 2) @ wabs.view(wabs.shape[0], -1, 32).sum(-1).t() * (1 + 1e-5) + 1e-5 * x.double().abs() @ got.abs().double().t()
    assert torch.all((y - ref).abs() <= tol + 1e-6), name


def _ggml_dequantize(raw, type_id):
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        return q4_repack.dequantize_q4(raw, type_id)
    ref = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType(type_id)))
    assert torch.equal(ref, q4_repack.dequantize_q4(raw, type_id))  # our twin is ggml's formula
    return ref


def test_fused_parts_in_different_act_orders_are_dequantized(tmp_path, monkeypatch):
    """q/k/v (and gate/up) each in its own act order cannot share one input permutation: those fused
    layers are dequantized (exactly, from Q4_0), o/down stay in blocks; greedy ids as transformers'
    up to near-ties, and the start-up line says so."""
    kinds, _ = ops.gguf_kernel_types()
    if not {"Q4_0", "Q4_1"} <= kinds:
        pytest.skip("no Q4 kernels on this platform")
    from pagedllm.models import loader
    monkeypatch.setattr(loader, "GGUF_BLOCKS_MIN_FLOAT_BYTES", 0)
    qdir, odir, parts = write_int4(str(tmp_path), "llama", "gptq", 64, True, True, shared_order=False)
    with pagedllm_logs() as records:
        llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    line = next(r.getMessage() for r in records if r.getMessage().startswith("int4 checkpoint"))
    assert "4 fused layers dequantized (parts quantized in different act orders)" in line, line
    assert sorted(n.rsplit(".", 1)[1] for n, _ in _block_layers(llm)) == ["down_proj"] * 2 + ["o_proj"] * 2
    model = llm.llm_engine.executor.runner.model
    for i in range(2):
        for fused in ("qkv_proj", "gate_up_proj"):
            layer = model.get_submodule(f"layers.{i}.{'self_attn' if fused == 'qkv_proj' else 'mlp'}.{fused}")
            want = torch.cat([dequantize(*parts[f"model.layers.{i}.{'self_attn' if fused == 'qkv_proj' else 'mlp'}.{p}"])
                              for p in _FUSED[fused]])
            x = torch.randn(3, want.shape[1])
            assert torch.allclose(layer(x), x @ want.t(), atol=1e-5)  # (its weight is packed for the float GEMM)
    prompts = make_prompts(llm.llm_engine.vocab_size, [3, 30], seed=6)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert greedy_up_to_near_ties(_hf(odir), prompts, ids) >= 4
    assert_pool_empty(llm)


# ----------------------------------------------------------------------------------- refusals and errors
def _edit(qdir, config=None, tensors=None):
    if config is not None:
        with open(os.path.join(qdir, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"].update(config)
        with open(os.path.join(qdir, "config.json"), "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        path = os.path.join(qdir, "model.safetensors")
        ts = load_file(path)
        tensors(ts)
        save_file(ts, path)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("method,config,tensors,message", [
    ("gptq", {"bits": 3}, None, "GPTQ checkpoint: bits 3 is not supported"),
    ("gptq", {"checkpoint_format": "marlin"}, None, "checkpoint_format 'marlin' is not supported"),
    ("awq", {"version": "gemv"}, None, "AWQ checkpoint: version 'gemv' is not supported"),
    ("compressed-tensors", {"format": "float-quantized"}, None, "format 'float-quantized'"),
    ("gptq", None, lambda ts: ts.update({f"{Q}.scales": ts[f"{Q}.scales"][:, :64].contiguous()}),
     f"{Q}.scales has shape (4, 64), expected (4, 128)"),
    ("gptq", None, lambda ts: ts.pop(f"{Q}.qzeros"), f"{Q}.qzeros is missing"),
    ("awq", None, lambda ts: ts.update({f"{Q}.qweight": ts[f"{Q}.qweight"].float()}),
     f"{Q}.qweight is torch.float32, expected torch.int32"),
    ("gptq", None, lambda ts: ts.update({f"{Q}.g_idx": ts[f"{Q}.g_idx"] + 7}), f"{Q}.g_idx has groups outside"),
    ("compressed-tensors", None, lambda ts: ts.update({f"{Q}.weight_scale": ts[f"{Q}.weight_scale"][:, :3].contiguous()}),
     f"{Q}.weight_scale has shape (128, 3)"),
])
def test_malformed_int4_checkpoint_is_a_clear_error(tmp_path, method, config, tensors, message):
    qdir, _, _ = write_int4(str(tmp_path), "llama", method, 32, method != "awq", False)
    _edit(qdir, config, tensors)
    with pytest.raises(ValueError, match=_re(message)):
        LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)


def _re(s):
    import re
    return re.escape(s)


def test_int4_linear_group_not_a_multiple_of_32_is_dequantized():
    """A group of 16 cannot fill ggml's 32-weight blocks: to_blocks says so (the loader then
    dequantizes that layer, exactly)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=gen)
    q, s, z, g = quantize(w, 16, True, None)
    got = q4_repack.to_blocks(q4_repack.Int4Weight(q, s, z.to(torch.int16), g))
    assert isinstance(got, str) and "multiple of 32" in got
    q, s, z, g = quantize(w, 32, False, torch.randperm(64, generator=gen))
    blocks = q4_repack.to_blocks(q4_repack.Int4Weight(q, s, z.to(torch.int16), g))
    assert blocks.type_name == "Q4_1" and blocks.perm is not None
    deq = q4_repack.dequantize_q4(blocks.raw, blocks.ggml_type)
    assert torch.allclose(torch.empty_like(deq).index_copy_(1, blocks.perm, deq), dequantize(q, s, z, g),
                          atol=float(s.float().max()) * 16 * 2.0 ** -11)
    assert torch.equal(blocks.dequantize(), dequantize(q, s, z, g))


def test_int4_checkpoint_tensor_parallel(tmp_path):
    """Two tensor-parallel ranks: the blocks path is one rank only, so each rank dequantizes at load
    and its float layers take their slices as from a float checkpoint (act order and zero points
    included): greedy ids equal transformers'."""
    qdir, odir, _ = write_int4(str(tmp_path), "qwen2", "gptq", 32, False, True, v1=False)
    hf = _hf(odir)
    llm = LLM(qdir, tensor_parallel_size=2, kv_cache_memory=2 << 20, max_model_len=256)
    try:
        prompts = make_prompts(llm.llm_engine.vocab_size, [5, 40], seed=2)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == [hf_greedy(hf, p, 8)[0] for p in prompts]
        assert_pool_empty(llm)
    finally:
        del llm


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_int4_moe_checkpoint(tmp_path, monkeypatch, arch):
    """A MoE quantized per expert (as GPTQ releases of Qwen-MoE and Mixtral are): the experts are
    dequantized at load (their stacked loaders take floats), the attention (and a shared expert's)
    linears go to the kernels; greedy = transformers on the dequantized path, up to near-ties on the
    kernel path."""
    qdir, odir, parts = write_int4(str(tmp_path), arch, "gptq", 32, True, False)
    assert any(".experts." in name for name in parts)
    hf = _hf(odir)
    llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    prompts = make_prompts(llm.llm_engine.vocab_size, [4, 33], seed=1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, 8)[0] for p in prompts]
    del llm
    from pagedllm.models import loader
    monkeypatch.setattr(loader, "GGUF_BLOCKS_MIN_FLOAT_BYTES", 0)
    with pagedllm_logs() as records:
        llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    line = next(r.getMessage() for r in records if r.getMessage().startswith("int4 checkpoint"))
    assert "Q4_0 in blocks" in line and "dequantized to float32 (not a linear layer that takes blocks)" in line, line
    assert _block_layers(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert greedy_up_to_near_ties(hf, prompts, got) >= 4
    assert_pool_empty(llm)


def test_int4_quantized_lm_head_in_blocks(tmp_path, monkeypatch):
    """GPTQModel's ``lm_head: true`` (an untied head quantized in act order): on the kernel path the
    head is a block layer too (its input gathered by its own order); greedy = transformers on the
    dequantized path, up to near-ties on the kernel path."""
    qdir, odir, parts = write_int4(str(tmp_path), "llama", "gptq", 32, False, True, lm_head=True)
    assert "lm_head" in parts
    hf = _hf(odir)
    llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    prompts = make_prompts(llm.llm_engine.vocab_size, [4, 33], seed=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [hf_greedy(hf, p, 8)[0] for p in prompts]
    del llm
    kinds, _ = ops.gguf_kernel_types()
    if not {"Q4_0", "Q4_1"} <= kinds:
        pytest.skip("no Q4 kernels on this platform")
    from pagedllm.models import loader
    monkeypatch.setattr(loader, "GGUF_BLOCKS_MIN_FLOAT_BYTES", 0)
    llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    head = dict(_block_layers(llm)).get("lm_head")
    assert head is not None and head.gguf_perm is not None
    x = torch.randn(3, 128)
    want = dequantize(*parts["lm_head"])
    assert torch.allclose(head.compute_logits(x), x @ want.t(), atol=0.05)  # (8-bit activations)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert greedy_up_to_near_ties(hf, prompts, got) >= 4
    assert_pool_empty(llm)


def test_int4_tied_head_requantized_to_q8_0(tmp_path, monkeypatch):
    """A tied float16 embedding (Qwen2.5's int4 checkpoints): the dequantized path is unchanged
    (greedy = transformers); on the kernel path the head multiplies Q8_0 blocks of the table (ggml's
    quantize_row_q8_0, bit for bit), its logits within the weights' Q8_0 error plus the int8-activation
    bound of x @ W^T, the lookup reads the float16 table exactly, and greedy is within near-ties."""
    from pagedllm.layers.quantization.gguf import q8_0_blocks
    qdir, odir, parts = write_int4(str(tmp_path), "qwen2", "gptq", 32, True, False, tied=True)
    hf = _hf(odir)
    assert hf.config.tie_word_embeddings
    llm = LLM(qdir, kv_cache_memory=2 << 20, max_model_len=256)
    prompts = make_prompts(llm.llm_engine.vocab_size, [4, 33, 70], seed=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [hf_greedy(hf, p, 8)[0] for p in prompts]
    assert not _block_layers(llm)
    del llm
    llm, line = _on_kernels(qdir, monkeypatch, {"Q4_0", "Q8_0"})
    assert "LM head: Q8_0 blocks (requantized from the tied embedding, whose lookup reads its float16 table)" in line
    model = llm.llm_engine.executor.runner.model
    head, emb = model.lm_head, model.embed_tokens
    table = hf.model.embed_tokens.weight.detach()
    assert head.weight is None and head.gguf_segments[0][1] == 8
    assert emb.weight.dtype == torch.float16 and torch.equal(emb.weight.float(), table)
    ids = torch.tensor([0, 7, table.shape[0] - 1])
    assert emb(ids).dtype == torch.float32 and torch.equal(emb(ids), table[ids])
    raw = head.gguf_segments[0][2]
    try:
        from gguf import GGMLQuantizationType, quants
        assert np.array_equal(raw.numpy(), quants.quantize(table.numpy(), GGMLQuantizationType.Q8_0))
        wq = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType.Q8_0)).double()
    except ImportError:
        wq = None
    assert torch.equal(raw, q8_0_blocks(table))
    torch.manual_seed(0)
    for rows in (1, 6):  # decode and prefill shapes
        x = torch.randn(rows, table.shape[1])
        y = head.compute_logits(x).double()
        if wq is not None:  # the int8-activation bound against the Q8_0 weights
            d = x.double().abs().view(rows, -1, 32).amax(-1) / 127
            tol = (d / 2) @ wq.abs().view(wq.shape[0], -1, 32).sum(-1).t() * (1 + 1e-5) + 1e-5 * x.double().abs() @ wq.abs().t()
            assert torch.all((y - x.double() @ wq.t()).abs() <= tol + 1e-6)
        # and against the float table: plus the weights' Q8_0 step (d_w / 2 per weight, + fp16 rounding of d_w)
        dw = table.double().abs().view(table.shape[0], -1, 32).amax(-1) / 127
        wtol = x.double().abs().view(rows, -1, 32).sum(-1) @ (dw * (0.5 + 2.0 ** -11 * 127)).t()
        dx = x.double().abs().view(rows, -1, 32).amax(-1) / 127
        xtol = (dx / 2) @ (table.double().abs() + dw.repeat_interleave(32, 1)).view(table.shape[0], -1, 32).sum(-1).t()
        assert torch.all((y - x.double() @ table.double().t()).abs() <= wtol + xtol * (1 + 1e-5) + 1e-5)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_pool_empty(llm)
    assert greedy_up_to_near_ties(hf, prompts, got) >= 12
