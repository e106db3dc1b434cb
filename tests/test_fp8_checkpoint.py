"""FP8 checkpoints (quant_method "fp8": DeepSeek-V3's block-wise e4m3 weights with weight_scale_inv,
and per-tensor / per-channel scales) are dequantized at load: the engine's fp32 greedy ids equal
transformers' on the float checkpoint those FP8 weights stand for; checkpoints quantized with a
method the loader cannot read are refused with a clear error."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import fp8
from test_correctness import make_prompts, reference
from test_models_deepseek import build_checkpoint

FP8_MAX = 448.0  # largest e4m3fn value


def quantize_blocks(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 weight, float32 scale [ceil(out / br), ceil(in / bc)]), each block scaled
    so that its largest |x| is FP8_MAX (DeepSeek-V3's recipe)."""
    out, cols = w.shape
    scale = torch.empty(-(-out // br), -(-cols // bc))
    q = torch.empty(out, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale[i, j] = block.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_definition(q: torch.Tensor, scale: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = q[r, c].float() * scale[r // br, c // bc]
    return out


def write_fp8_pair(src: str, fp8_dir: str, float_dir: str, block: tuple[int, int]) -> None:
    """From the float checkpoint ``src``: an FP8 checkpoint (the projections' weights block-quantized,
    as DeepSeek-V3 ships; embeddings, norms, routers and the LM head float) and the float checkpoint
    it stands for (the same weights dequantized), the oracle's."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"):
            q, s = quantize_blocks(w, *block)
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = q, s
            dequantized[name] = dequantize_by_definition(q, s, *block)
        else:
            quantized[name] = dequantized[name] = w
    for out_dir, weights, quant in ((fp8_dir, quantized, True), (float_dir, dequantized, False)):
        os.makedirs(out_dir, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors":
                with open(os.path.join(src, f), "rb") as a, open(os.path.join(out_dir, f), "wb") as b:
                    b.write(a.read())
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        if quant:
            with open(os.path.join(out_dir, "config.json")) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": list(block)}
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(cfg, f)


def test_dequantize_block_channel_and_tensor_scales():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 70, generator=g)  # blocks of 16 x 32: partial blocks on both edges
    q, s = quantize_blocks(w, 16, 32)
    assert s.shape == (3, 3)
    got = fp8.dequantize(q, s, [16, 32])
    assert torch.equal(got, dequantize_by_definition(q, s, 16, 32))
    torch.testing.assert_close(got, w, rtol=0.07, atol=0.0)  # e4m3 keeps 3 mantissa bits
    per_row = torch.rand(40, generator=g) + 0.5
    assert torch.equal(fp8.dequantize(q, per_row), q.float() * per_row.view(40, 1))
    assert torch.equal(fp8.dequantize(q, per_row.view(40, 1)), q.float() * per_row.view(40, 1))
    assert torch.equal(fp8.dequantize(q, torch.tensor(0.25)), q.float() * 0.25)
    stacked = torch.stack([q, q])  # stacked experts [E, out, in] with [E, blocks, blocks] scales
    assert torch.equal(fp8.dequantize(stacked, torch.stack([s, 2 * s]), [16, 32])[1], 2 * got)
    with pytest.raises(ValueError, match=r"FP8 weight \(40, 70\) with scale \(3, 2\)"):
        fp8.dequantize(q, s[:, :2], [16, 32])
    # The weight and its scale pair up in either order; activation scales are dropped; float tensors pass.
    pairs = [("a.weight_scale_inv", s), ("a.weight", q), ("b.weight", q), ("b.input_scale", torch.ones(())),
             ("b.weight_scale_inv", s), ("n.weight", w)]
    out = dict(fp8.dequantized(pairs, {"weight_block_size": [16, 32]}))
    assert list(out) == ["a.weight", "b.weight", "n.weight"] and torch.equal(out["a.weight"], got)
    assert out["n.weight"] is w
    with pytest.raises(ValueError, match=r"weights without a scale \['c'\]"):
        list(fp8.dequantized([("c.weight", q)], {}))


def test_fp8_deepseek_v3_matches_transformers_on_the_dequantized_weights(tmp_path):
    src = build_checkpoint(str(tmp_path / "float"), "v3", seed=5)
    fp8_dir, float_dir = str(tmp_path / "fp8"), str(tmp_path / "dequantized")
    write_fp8_pair(src, fp8_dir, float_dir, (16, 16))
    vocab = transformers.AutoConfig.from_pretrained(fp8_dir).vocab_size
    prompts = make_prompts(vocab, [4, 30, 70], seed=8)
    ref = [r[0] for r in reference(float_dir, prompts, n=10)]
    llm = LLM(fp8_dir, kv_cache_memory=2 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    attn = llm.llm_engine.executor.runner.model.layers[1].self_attn
    dq = load_file(os.path.join(float_dir, "model.safetensors"))["model.layers.1.self_attn.kv_b_proj.weight"]
    assert torch.equal(attn.kv_b_proj.weight, dq)  # the loaded weight is the dequantized one, exactly
    assert_pool_empty(llm)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized with 'bitsandbytes', which pagedllm cannot load"),
    ({"quant_method": "gptq", "bits": 8}, "GPTQ checkpoint: bits 8 is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {}}}},
     "compressed-tensors checkpoint: format 'float-quantized' of config group 'g' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
])
def test_unreadable_quantized_checkpoints_are_refused(tmp_path, quant, message):
    d = build_checkpoint(str(tmp_path), "v2_lite", seed=1)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=message):
        LLM(d, kv_cache_memory=1 << 20)


def test_scale_slices_upper_case_method_and_unreadable_float8(tmp_path):
    """A 0-d per-tensor scale read as a safetensors slice (as the loader reads it); "FP8" in capitals
    is fp8; float8 tensors in a checkpoint without an FP8 config are refused, not cast; a pairing
    error names its tensor."""
    from safetensors import safe_open

    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    s = w.abs().max() / FP8_MAX
    q = (w / s).to(torch.float8_e4m3fn)
    save_file({"a.weight": q, "a.weight_scale": s, "b.weight_scale": s.clone().view(1), "b.weight": q.clone()},
              str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        out = dict(fp8.dequantized([(k, f.get_slice(k)) for k in f.keys()], {"quant_method": "fp8"}))
    assert torch.equal(out["a.weight"], q.float() * s) and torch.equal(out["b.weight"], q.float() * s)

    src = build_checkpoint(str(tmp_path / "float"), "v2_lite", seed=4)
    fp8_dir, float_dir = str(tmp_path / "fp8"), str(tmp_path / "dequantized")
    write_fp8_pair(src, fp8_dir, float_dir, (16, 32))
    cfg_path = os.path.join(fp8_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["quant_method"] = "FP8"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    vocab = transformers.AutoConfig.from_pretrained(fp8_dir).vocab_size
    prompts = make_prompts(vocab, [6, 25], seed=9)
    llm = LLM(fp8_dir, kv_cache_memory=1 << 20)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                                                ignore_eos=True), use_tqdm=False)]
    assert got == [r[0] for r in reference(float_dir, prompts, n=6)]
    del cfg["quantization_config"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"float8 tensor, but config.json declares no FP8 quantization_config"):
        LLM(fp8_dir, kv_cache_memory=1 << 20)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}  # not the scales' blocks
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"cannot load \S+: model\.layers\.\d\.\S+_proj\S*\.weight: FP8 weight"):
        LLM(fp8_dir, kv_cache_memory=1 << 20)
