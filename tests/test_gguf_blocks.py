"""GGUF weights kept in their ggml blocks (layers/quantization/gguf.py, platforms/cpu/gguf_gemm.cpp)
through the engine: a tiny Llama written to GGUF here with K-quant and 32-block types (the K-quant
blocks are random bytes with small fp16 scales: ``gguf.quants`` cannot quantize K types, and the
oracle reads the file, not the checkpoint it came from).

Oracles: transformers loading the same file (it dequantizes with ``gguf.quants``) and our own
dequantized path (the kernels switched off), greedy and fp32. The kernels quantize each block of 32
activations to int8 (error <= max|x| / 254 an element, tests/test_gguf_gemm.py), so the logits
differ from the float path's by a little; greedy ids agree unless two logits lie closer than that,
and the logits are checked close as well."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_pool_empty, build_checkpoint, greedy_up_to_near_ties, pagedllm_logs
from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import resident_bytes
from pagedllm.platforms import ops
from pagedllm.platforms.cpu import gguf_gemm
from test_correctness import hf_greedy, make_prompts
from test_gguf import _hf_from_gguf, write_llama_gguf

gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "Q6_K", "Q5_0", "Q4_1", "Q5_1")
_BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}


def _k_quant(a: np.ndarray, qtype) -> np.ndarray:
    """Random-byte blocks of a K type for a matrix shaped like ``a`` (fp16 scales set to small values)."""
    elems, nbytes, halves = _BLOCK[qtype.name]
    rng = np.random.default_rng(a.shape[0] * 7 + a.shape[1])
    raw = rng.integers(0, 256, size=(a.shape[0], a.shape[1] // elems, nbytes), dtype=np.uint8)
    for off in halves:
        scale = rng.uniform(1e-4, 4e-4, size=raw.shape[:2]) * rng.choice([-1, 1], size=raw.shape[:2])
        raw[:, :, off:off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(a.shape[0], -1)


def _write_with_k_quants(hf_dir: str, path: str, quant_types) -> dict:
    """``write_llama_gguf`` with the K types' blocks made by ``_k_quant`` (gguf.quants cannot quantize them)."""
    real = gguf.quants.quantize

    def quantize(a, qtype):
        return _k_quant(a, qtype) if qtype.name in _BLOCK else real(a, qtype)

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf.quants, "quantize", quantize)
    try:
        return write_llama_gguf(hf_dir, path, quant_types=quant_types)
    finally:
        mp.undo()


@pytest.fixture(autouse=True)
def _blocks_at_any_size(monkeypatch):
    """The tiny files are far under the size from which the loader keeps blocks by default."""
    from pagedllm.models import loader
    monkeypatch.setattr(loader, "GGUF_BLOCKS_MIN_FLOAT_BYTES", 0)


@pytest.fixture(scope="module")
def block_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_blocks")
    hf_dir = build_checkpoint(str(root / "hf"), "llama", seed=11, hidden_size=256, intermediate_size=512)
    path = str(root / "tiny-kquants.gguf")
    types = _write_with_k_quants(hf_dir, path, TYPES)
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} <= set(types.values())
    return path


def _layers(llm):
    model = llm.llm_engine.executor.runner.model
    return [m for m in model.modules() if getattr(m, "gguf_segments", None) is not None]


# How far below transformers' best logit the kernels' greedy choice may be (teacher-forced on our ids):
# the tiny model's logits have a std of about 1.2, and the 8-bit activations moved near-ties of
# 0.01-0.03 (measured); a wrong kernel picks tokens a std or more below.
NEAR_TIE = 0.1


def test_blocks_greedy_equal_transformers_and_dequantized(block_gguf, monkeypatch):
    """Our dequantized path equals transformers token for token. With the kernels, every greedy
    token is transformers' best or within NEAR_TIE of it (fed our own ids), and a step whose
    top-2 gap exceeds NEAR_TIE picks the same token."""
    path = block_gguf
    llm = LLM(path, kv_cache_memory=2 << 20, max_model_len=256)
    layers = _layers(llm)
    assert len(layers) >= 4  # the 2 layers' o/down/gate_up and the qkv whose parts all have kernels
    kinds = set().union(*(m.gguf_types for m in layers))
    assert {"Q4_K", "Q6_K"} <= kinds
    # weights stay as the file's bytes: segments of the un-permuted tensors are views of its memory map
    mapped = [raw for m in layers for _, _, raw in m.gguf_segments if not m.prefix.endswith("qkv_proj")]
    for raw in mapped:
        base = raw
        while base.base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap)
    assert all(m.weight is None for m in layers)
    assert any(getattr(m, "is_lm_head", False) for m in layers)  # the untied output matrix too
    prompts = make_prompts(llm.llm_engine.vocab_size, [3, 30, 70], seed=6)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_pool_empty(llm)
    hf = _hf_from_gguf(path)
    assert greedy_up_to_near_ties(hf, prompts, ids) >= 12  # most steps are clear choices: the check has teeth
    del llm
    # the dequantized path (no kernels) on the same file: transformers' ids exactly
    monkeypatch.setattr(ops, "gguf_kernel_types", lambda: (frozenset(), "off for the test"))
    llm = LLM(path, kv_cache_memory=2 << 20, max_model_len=256)
    assert not _layers(llm)
    want = [hf_greedy(hf, p, 8)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert_pool_empty(llm)


def test_block_linear_close_to_float(block_gguf):
    """Each kept layer's output against its dequantized weight in float64, within the bound of the
    activations' 8-bit quantization (tests/test_gguf_gemm.py derives it)."""
    llm = LLM(block_gguf, kv_cache_memory=2 << 20, max_model_len=256)
    torch.manual_seed(0)
    for m in _layers(llm):
        _, first_type, first_raw = m.gguf_segments[0]
        _, elems, nbytes = gguf_gemm.TYPES[first_type]
        _assert_within_int8_bound(m, torch.randn(5, first_raw.shape[1] // nbytes * elems))


def test_mixed_rows_fall_back_to_float(block_gguf, monkeypatch):
    """A fused layer with a part of a type without a kernel is dequantized whole: it multiplies by
    transformers' dequantized parts (both ``gguf.quants`` in float32; float matmul rounding apart)."""
    monkeypatch.setattr(ops, "gguf_kernel_types", lambda: (frozenset({"Q4_K", "Q8_0"}), "two types for the test"))
    llm = LLM(block_gguf, kv_cache_memory=2 << 20, max_model_len=256)
    model = llm.llm_engine.executor.runner.model
    hf = dict(_hf_from_gguf(block_gguf).named_parameters())
    parts = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
             "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}
    fell_back = kept = 0
    for i, layer in enumerate(model.layers):
        for name, (where, hf_names) in parts.items():
            m = getattr(getattr(layer, where), name)
            want = torch.cat([hf[f"model.layers.{i}.{where}.{h}.weight"] for h in hf_names])
            if getattr(m, "gguf_segments", None) is not None:
                assert m.gguf_types <= {"Q4_K", "Q8_0"}
                kept += 1
            else:
                x = torch.randn(3, m.input_size)  # (the float method may have packed its weight away)
                torch.testing.assert_close(m(x), x @ want.detach().t(), rtol=1e-4, atol=1e-4)
                fell_back += bool(getattr(m, "gguf_types", None))
    assert fell_back >= 1 and kept >= 1
    out = llm.generate(make_prompts(llm.llm_engine.vocab_size, [5], seed=2), GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert_pool_empty(llm)


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    """A tiny Llama with a tied LM head: the file has no output matrix and a Q6_K token embedding
    (what llama-quantize gives a tied model's Q4_K_M), the rest as ``block_gguf``."""
    root = tmp_path_factory.mktemp("gguf_tied")
    hf_dir = build_checkpoint(str(root / "hf"), "llama", seed=12, hidden_size=256, intermediate_size=512,
                              tie_word_embeddings=True)
    path = str(root / "tiny-tied.gguf")
    types = _write_with_k_quants(hf_dir, path, TYPES[1:] + TYPES[:1])
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
    return path


def _assert_within_int8_bound(m, x: torch.Tensor) -> None:
    """``m``'s output on ``x`` [M, K] against its blocks dequantized, in float64, within the bound of
    the activations' 8-bit quantization (tests/test_gguf_gemm.py derives it), per segment: x goes in
    blocks of 32, or of 256 against a K-quant's rows (``gguf_gemm.act_block``)."""
    y = (m.compute_logits(x) if getattr(m, "is_lm_head", False) else m(x)).double()
    xd = x.double()
    for first, t, raw in m.gguf_segments:
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))).double()
        blk = gguf_gemm.act_block(t)
        ref = xd @ w.t()
        d = xd.abs().view(x.shape[0], -1, blk).amax(-1) / 127
        tol = (d / 2) @ w.abs().view(w.shape[0], -1, blk).sum(-1).t() * (1 + 1e-5) + 1e-5 * xd.abs() @ w.abs().t()
        assert torch.all((y[:, first:first + w.shape[0]] - ref).abs() <= tol + 1e-6), (m.prefix, t)


def test_tied_head_and_embedding_in_blocks(tied_gguf, monkeypatch):
    """A tied Q6_K embedding stays in the file's blocks: the lookup dequantizes the looked-up rows
    (equal to ggml's dequantization), the LM head multiplies the same blocks (logits within the
    int8-activation bound of x @ W^T, decode and prefill shapes), no float table is resident, the
    start-up line says so, and greedy ids are within near-ties of transformers; with the kernels off
    the ids equal transformers'."""
    with pagedllm_logs() as records:
        llm = LLM(tied_gguf, kv_cache_memory=2 << 20, max_model_len=256)
    model = llm.llm_engine.executor.runner.model
    emb, head = model.embed_tokens, model.lm_head
    assert emb.gguf_embedding.type_name == "Q6_K" and emb.weight.numel() == 0
    assert head.weight is None and head.gguf_tied and head.gguf_segments[0][2] is emb.gguf_embedding.raw
    table = torch.from_numpy(gguf.quants.dequantize(emb.gguf_embedding.raw, gguf.GGMLQuantizationType.Q6_K))
    ids = torch.tensor([[0, 5, 17], [table.shape[0] - 1, 5, 2]])
    assert torch.equal(emb(ids), table[ids])
    torch.manual_seed(0)
    for rows in (1, 7):  # decode and prefill shapes
        _assert_within_int8_bound(head, torch.randn(rows, table.shape[1]))
    line = next(r.getMessage() for r in records if r.getMessage().startswith("GGUF weights"))
    assert "LM head: Q6_K blocks (tied: the embedding's)" in line, line
    kept, floats = resident_bytes(model)
    assert kept >= emb.gguf_embedding.raw.nbytes and floats < table.numel() * 4
    prompts = make_prompts(llm.llm_engine.vocab_size, [3, 30, 70], seed=7)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_pool_empty(llm)
    hf = _hf_from_gguf(tied_gguf)
    assert hf.config.tie_word_embeddings
    assert greedy_up_to_near_ties(hf, prompts, got) >= 12
    del llm
    monkeypatch.setattr(ops, "gguf_kernel_types", lambda: (frozenset(), "off for the test"))
    llm = LLM(tied_gguf, kv_cache_memory=2 << 20, max_model_len=256)
    assert getattr(llm.llm_engine.executor.runner.model.embed_tokens, "gguf_embedding", None) is None
    want = [hf_greedy(hf, p, 8)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert_pool_empty(llm)


@pytest.fixture(scope="module")
def qwen2_block_gguf(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) in GGUF, every linear in blocks of ``TYPES`` (none pinned to F32)."""
    import test_gguf

    root = tmp_path_factory.mktemp("gguf_qwen2_blocks")
    hf_dir = build_checkpoint(str(root / "hf"), "qwen2", seed=13, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=2)
    path = str(root / "tiny-qwen2.gguf")
    real = gguf.quants.quantize
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.quants, "quantize", lambda a, q: _k_quant(a, q) if q.name in _BLOCK else real(a, q))
        mp.setattr(test_gguf, "PINNED", {})
        write_llama_gguf(hf_dir, path, quant_types=TYPES, arch="qwen2")
    return path


def test_layer_runner_takes_block_layers(qwen2_block_gguf, monkeypatch):
    """The CPU layer runner (platforms/cpu/layer_runner.py) runs layers whose linears stay in GGUF blocks
    through gguf_gemm's ``gguf_linear``, biases added as GGUFLinearMethod adds them: greedy ids and
    logprobs equal to the Python layer loop's exactly, over prefill chunks and decodes, in float32 on
    the native build and on the AVX2-only one (the layer loop switched to the same library), and in
    bfloat16 (x and y through float32, as the method's ``x.float()`` and ``.to(x.dtype)``)."""
    from test_cpu_layer_runner import _model, _run

    native = gguf_gemm._LIBRARY
    for dtype, build in (("float32", "native"), ("float32", "avx2"), ("bfloat16", "native")):
        if build == "avx2":  # both paths on the AVX2-only kernels (maddubs, no VNNI, no AVX-512)
            flags = gguf_gemm.BASE_FLAGS + ["-mno-avx512f", "-mno-avxvnni", "-mno-avx512vnni"]
            monkeypatch.setattr(gguf_gemm, "_LIBRARY", gguf_gemm.LazyLibrary(lambda: gguf_gemm.build_with(flags)))
            del model.__dict__["_cpu_layer_runner"]  # built again, on that library's gguf_linear
        elif dtype == "bfloat16":
            monkeypatch.setattr(gguf_gemm, "_LIBRARY", native)
            del llm
        if build == "native":
            llm = LLM(qwen2_block_gguf, dtype=dtype, kv_cache_memory=2 << 20, max_model_len=256,
                      max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False)
            model = _model(llm)
            lins = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            assert all(getattr(lin, "gguf_segments", None) is not None for lin in lins)
            assert set().union(*(lin.gguf_types for lin in lins)) >= {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"}
            assert lins[0].bias is not None
            prompts = make_prompts(llm.llm_engine.vocab_size, [3, 70], seed=8)  # 70: two prefill chunks of 64
        loop = _run(llm, prompts, False)
        runner = _run(llm, prompts, True)
        assert runner == loop, (dtype, build)
    assert_pool_empty(llm)
