"""The Triton paged-attention backend (``platforms/cuda/triton_attention.py``) equals the torch reference,
run on the CPU through Triton's interpreter: the K/V write (the int8 cache byte for byte), decodes by
flash-decoding and through the prefill kernel, chunked prefills over cached prefixes in one batch, random
block tables, block sizes 8-32, GQA ratios 1-8, fp32/bf16/fp16, windows, soft-caps, sinks, Llama 4's
chunks, the int8 and one-plane caches; and the engine with ``attention_backend="triton"`` gives
transformers' greedy tokens. Skipped where triton is not installed."""
from __future__ import annotations

import os
import random

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined: set it before the kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install pagedllm[test])")

from pagedllm.layers.attention import AttentionMetadata, TorchPagedAttention, get_attention_backend  # noqa: E402
from pagedllm.layers.attention import kv_quant  # noqa: E402
from pagedllm.layers.attention.backend import write_kv as torch_write_kv  # noqa: E402
from pagedllm.layers.attention.triton_backend import TritonPagedAttention, interpreting  # noqa: E402
from pagedllm.platforms.cuda import triton_attention as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET was set to off before this module")


def make_batch(seqs, block_size, hkv, group, d, dtype, seed, int8=False, planes=2):
    """seqs: (cached prefix, new tokens) per sequence, decodes (new == 1) first. The prefixes are written
    at random physical blocks by the torch reference's write; returns (q, k, v, kv_cache, meta)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + len(seqs) + 2
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    rows = kv_quant.block_rows(block_size, d, "int8" if int8 else "auto")
    kv_cache = torch.zeros(planes, num_blocks, rows, hkv, d, dtype=torch.int8 if int8 else dtype)
    tables, slot_mapping, ks, vs = [], [], [], []
    for (c, n), nb in zip(seqs, need):
        table = [perm.pop() for _ in range(nb + rng.randrange(2))]  # sometimes a spare block at the end
        tables.append(table)
        fk = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        fv = fk if planes == 1 else torch.randn(c + n, hkv, d, generator=g).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c + n)])
        torch_write_kv(fk[:c], fv[:c], kv_cache, slots[:c])
        slot_mapping.append(slots[c:])
        ks.append(fk[c:])
        vs.append(fv[c:])
    q = torch.randn(sum(n for _, n in seqs), hkv * group, d, generator=g).to(dtype)
    meta = AttentionMetadata.build(torch.cat(slot_mapping), tables, [c + n for c, n in seqs],
                                   [n for _, n in seqs], block_size, "cpu")
    return q, torch.cat(ks), torch.cat(vs), kv_cache, meta


def run_both(seqs, block_size, hkv, group, d, dtype, seed=0, int8=False, planes=2, decode_split=True, **kw):
    """(triton output, reference output, triton's cache, reference's cache) of one batch."""
    q, k, v, cache, meta = make_batch(seqs, block_size, hkv, group, d, dtype, seed, int8, planes)
    ref_cache, scale = cache.clone(), d ** -0.5
    backend = TritonPagedAttention()
    backend.decode_split = decode_split
    out = backend.forward(q, k, v, cache, meta, scale, **kw)
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale, **kw)
    return out, ref, cache, ref_cache


def assert_close(out, ref):
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    else:  # bf16/fp16: within a few of its roundings (the kernel rounds P to the dtype, as FlashAttention)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


# Decodes (contexts 1..300), then prompt chunks over cached prefixes and whole prompts.
MIXED = [(0, 1), (8, 1), (130, 1), (299, 1), (0, 37), (45, 19), (200, 64), (7, 2)]
SMALL = [(0, 1), (50, 1), (120, 1), (0, 21), (60, 18)]  # (the features' batch: the interpreter is slow)


@pytest.mark.parametrize("block_size,hkv,group,dtype,decode_split", [
    (8, 2, 1, torch.float32, True), (16, 1, 8, torch.float32, False), (32, 2, 3, torch.float32, True),
    (16, 2, 4, torch.bfloat16, False), (8, 1, 2, torch.float16, True), (32, 1, 5, torch.bfloat16, True)])
def test_mixed_batch_matches_reference(block_size, hkv, group, dtype, decode_split):
    out, ref, cache, ref_cache = run_both(MIXED, block_size, hkv, group, 32, dtype, seed=block_size + group,
                                          decode_split=decode_split)
    assert torch.equal(cache, ref_cache)  # the step's K/V written to the same slots
    assert_close(out, ref)


@pytest.mark.parametrize("kw", [dict(sliding_window=20), dict(sliding_window=1), dict(logits_soft_cap=5.0),
                                dict(sinks=True), dict(attention_chunk=48),
                                dict(sliding_window=40, logits_soft_cap=30.0, sinks=True),
                                dict(sliding_window=30, attention_chunk=64)], ids=str)
def test_features_match_reference(kw):
    if kw.pop("sinks", None):
        kw["sinks"] = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2
    for split in (True, False):
        out, ref, _, _ = run_both(SMALL, 16, 2, 4, 16, torch.float32, seed=5, decode_split=split, **kw)
        assert_close(out, ref)


def test_keys_behind_the_window_are_not_read():
    """Slots behind every query's window (or chunk) hold NaN, as a freed block in a cache that is not
    zeroed may: the output is the reference's on the clean cache."""
    for kw in (dict(sliding_window=5), dict(attention_chunk=24)):
        for split in (True, False):
            q, k, v, cache, meta = make_batch(SMALL, 8, 2, 2, 16, torch.float32, seed=6)
            ref = TorchPagedAttention().forward(q, k, v, cache, meta, 0.25, **kw)
            for b, (c, n) in enumerate(SMALL):  # the first query of b sits at position c
                lo = c - kw["sliding_window"] + 1 if "sliding_window" in kw else c // 24 * 24
                for p in range(max(lo, 0)):
                    cache[:, meta.block_tables[b, p // 8], p % 8] = float("nan")
            backend = TritonPagedAttention()
            backend.decode_split = split
            assert_close(backend.forward(q, k, v, cache, meta, 0.25, **kw), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_matches_reference(dtype):
    """The write quantizes to the reference's bytes (values and scales); attention dequantizes in place."""
    out, ref, cache, ref_cache = run_both(MIXED, 16, 2, 2, 32, dtype, seed=2, int8=True, sliding_window=100)
    assert torch.equal(cache, ref_cache)
    assert_close(out, ref)
    out, ref, _, _ = run_both(MIXED[:4], 8, 1, 4, 64, dtype, seed=4, int8=True, decode_split=False)
    assert_close(out, ref)


def test_quantize_rounds_half_to_even_as_torch():
    """Rows whose scaled values land on .5 exactly: the kernel rounds them as torch.round (half to even)."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 63.5, 0.0] * 2], dtype=torch.float32).view(1, 1, 16)
    x = torch.cat([x, torch.zeros(1, 1, 16), torch.randn(3, 1, 16) * 1e-3])  # and an all-zero row
    cache = torch.zeros(2, 2, 8 + kv_quant.scale_rows(8, 16), 1, 16, dtype=torch.int8)
    ref = cache.clone()
    slots = torch.tensor([3, 9, 0, 15, 4])
    kernels.write_kv(x, x, cache, slots, 8)
    torch_write_kv(x, x, ref, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("int8", [False, True])
def test_write_skips_negative_slots(int8):
    """A slot of -1 (a padding token) is written nowhere; the other tokens as the torch write puts them."""
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2))
    rows = kv_quant.block_rows(8, 16, "int8" if int8 else "auto")
    cache = torch.zeros(2, 3, rows, 2, 16, dtype=torch.int8 if int8 else torch.float32)
    ref = cache.clone()
    kernels.write_kv(x, -x, cache, torch.tensor([5, -1, 23, 0]), 8)
    keep = torch.tensor([0, 2, 3])
    torch_write_kv(x[keep], -x[keep], ref, torch.tensor([5, 23, 0]))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("d,group,dtype", [(32, 4, torch.float32), (576, 16, torch.float32), (576, 8, torch.bfloat16)])
def test_one_plane_cache(d, group, dtype):
    """MLA's one-plane cache (the keys are the values), at MLA's width (576 = 512 + 64) too."""
    for split in (True, False):
        out, ref, cache, ref_cache = run_both([(40, 1), (0, 9), (20, 5)], 8, 1, group, d, dtype, seed=7, planes=1,
                                              decode_split=split)
        assert torch.equal(cache, ref_cache)
        assert_close(out, ref)


def test_long_context():
    """A 1.5k-token decode split over programs, and a chunk over a 1k prefix."""
    seqs = [(1500, 1), (1000, 20)]
    assert kernels.num_splits(1501) == 6
    out, ref, _, _ = run_both(seqs, 32, 1, 2, 16, torch.float32, seed=8)
    assert_close(out, ref)


def test_more_splits_than_keys():
    """Flash-decoding with 16 splits of contexts of 1-121 keys (in a window of 50): empty splits weigh nothing."""
    q, k, v, cache, meta = make_batch(SMALL[:3], 8, 2, 2, 16, torch.float32, seed=9)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    ref = TorchPagedAttention().forward(q, k, v, cache, meta, 0.25, sliding_window=50, sinks=sinks)  # (writes K/V)
    out = kernels.paged_attention(q, cache, meta, 0.25, sliding_window=50, sinks=sinks, splits=16)
    assert_close(out, ref)


def test_selector_and_refusals(monkeypatch):
    from pagedllm.layers.attention import triton_backend

    assert (triton_backend.MAX_HEAD_DIM, triton_backend.SUPPORTED_DTYPES) == (kernels.MAX_HEAD_DIM,
                                                                             kernels.SUPPORTED_DTYPES)
    setup = dict(dtype=torch.float32, head_dim=64, block_size=16)
    assert get_attention_backend("auto", device="cpu", **setup).name == "cpu"  # interpreter or not
    assert get_attention_backend("triton", device="cpu", **setup).name == "triton"  # TRITON_INTERPRET=1
    assert get_attention_backend("auto", device="cuda", **setup).name == "triton"
    with pytest.raises(ValueError, match="head_dim 640 is outside 1..576"):
        get_attention_backend("triton", device="cuda", dtype=torch.float32, head_dim=640, block_size=16)
    with pytest.raises(ValueError, match="dtype torch.float64 is not"):
        get_attention_backend("triton", device="cuda", dtype=torch.float64, head_dim=64, block_size=16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors only"):
        get_attention_backend("triton", device="cpu", **setup)
    assert get_attention_backend("auto", device="cpu", **setup).name == "cpu"


def test_engine_greedy_matches_transformers(tmp_path):
    """A tiny random Llama through the engine with the Triton backend (interpreted): transformers' greedy
    tokens; prompts long enough for chunked prefill over a cached prefix, decodes in the same steps."""
    import transformers
    from conftest import assert_pool_empty, build_checkpoint
    from test_correctness import greedy, make_prompts, reference

    from pagedllm import LLM

    model_dir = build_checkpoint(str(tmp_path / "llama"), "llama", num_hidden_layers=1)
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(model_dir).vocab_size, lens=[1, 5, 40, 70])
    ref = reference(model_dir, prompts, n=6)
    llm = LLM(model_dir, kv_cache_memory=2 << 20, block_size=16, attention_backend="triton",
              max_num_batched_tokens=32)
    assert llm.llm_engine.executor.runner.model.layers[0].self_attn.backend.name == "triton"
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [toks for toks, _ in ref]
    assert_pool_empty(llm)


def test_engine_int8_cache_matches_reference_backend(tmp_path):
    """--kv-cache-dtype int8 through the engine: the Triton backend's greedy tokens are the torch reference's."""
    import transformers
    from conftest import assert_pool_empty, build_checkpoint
    from test_correctness import greedy, make_prompts

    from pagedllm import LLM

    model_dir = build_checkpoint(str(tmp_path / "llama"), "llama", num_hidden_layers=1)
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(model_dir).vocab_size, lens=[1, 5, 40, 70])
    tokens = {}
    for backend in ("triton", "torch"):
        llm = LLM(model_dir, kv_cache_memory=2 << 20, block_size=16, attention_backend=backend,
                  max_num_batched_tokens=32, kv_cache_dtype="int8")
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
        assert_pool_empty(llm)
    assert tokens["triton"] == tokens["torch"]
