"""The int8 KV cache (``--kv-cache-dtype int8``, layers/attention/kv_quant.py): the quantization's
error bound, the C writer's bytes equal the torch reference's, the compiled kernel over an int8
cache equals the torch reference (which equals a float64 oracle on the dequantized K/V), and the
engine: backends agree, output independent of batching, chunked prefill and preemption, logprobs
near the float cache, 3.8x the blocks in the same memory, pools empty."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import TorchPagedAttention, kv_quant, write_kv
from test_attention_kernel import _kernel, _random_seqs, dense_attention, make_batch
from test_quantization import GREEDY_TOP2, _ids, assert_same_greedy, make_prompts


def to_int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float cache [2, num_blocks, block_size, Hkv, D] as an int8 cache holding the same K/V
    quantized (the bytes of the scale rows past the scales are random)."""
    _, nb, bs, hkv, d = cache.shape
    rows = kv_quant.block_rows(bs, d, "int8")
    out = torch.randint(-128, 127, (2, nb, rows, hkv, d), dtype=torch.int8)
    for i in range(2):
        values, scales = kv_quant.split_blocks(out[i])
        q, s = kv_quant.quantize(cache[i])
        values.copy_(q)
        scales.copy_(s)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_error_bound(dtype):
    """Each element is within half a step (scale / 2) of its row's float value, the step is
    max|x| / 127, the row's largest element is exact up to float rounding, a zero row stays zero."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10).to(dtype)
    x[7, 1] = 0
    values, scales = kv_quant.quantize(x)
    xf = x.float()
    amax = xf.abs().amax(-1)
    torch.testing.assert_close(scales, amax / 127, rtol=0, atol=0)
    assert values.abs().max() == 127 and values.dtype == torch.int8
    err = (values.float() * scales.unsqueeze(-1) - xf).abs()
    assert (err <= scales.unsqueeze(-1) * (0.5 + 1e-5)).all()
    assert err.max() > 0.3 * scales.max()  # the bound is not loose: errors reach near half a step
    assert values[7, 1].abs().sum() == 0 and scales[7, 1] == 0
    assert torch.equal(kv_quant.roundtrip(x), (values.float() * scales.unsqueeze(-1)).to(dtype))


@pytest.mark.parametrize("cache", ["int8", "model"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 24, 64])
def test_c_writer_writes_the_reference_bytes(dtype, d, cache):
    """The kernel library's writer (the cpu backend's) on strided K/V views, as split from the fused
    qkv output, writes byte for byte what the torch reference writes, into the given slots only:
    an int8 cache (quantized) and a cache in the model's dtype (copied)."""
    from pagedllm.layers.attention.cpu_backend import write_kv_c

    _kernel()
    g = torch.Generator().manual_seed(d)
    qkv = (torch.randn(300, 7, d, generator=g) * 3).to(dtype)  # [N, H + 2 Hkv, D], H = 3, Hkv = 2
    k, v = qkv[:, 3:5], qkv[:, 5:7]
    k[4] = 0  # an all-zero row
    slots = torch.randperm(40 * 8, generator=g)[:300]
    if cache == "model":
        before = torch.randn(2, 40, 8, 2, d, generator=g).to(dtype)
        ref, got = before.clone(), before.clone()
        write_kv(k, v, ref, slots)
        write_kv_c(k, v, got, slots, 8)
        assert torch.equal(got, ref) and torch.equal(got[0].view(-1, 2, d)[slots], k)
        return
    before = torch.randint(-128, 127, (2, 40, kv_quant.block_rows(8, d, "int8"), 2, d), dtype=torch.int8, generator=g)
    ref, got = before.clone(), before.clone()
    write_kv(k, v, ref, slots)
    write_kv_c(k, v, got, slots, 8)
    assert torch.equal(got, ref)
    for i, x in enumerate((k, v)):  # the written slots hold x quantized; the others are untouched
        values, scales = kv_quant.split_blocks(ref[i])
        q, s = kv_quant.quantize(x)
        assert torch.equal(values[slots // 8, slots % 8], q) and torch.equal(scales[slots // 8, slots % 8], s)
        untouched = torch.ones(40 * 8, dtype=torch.bool)
        untouched[slots] = False
        old_values, old_scales = kv_quant.split_blocks(before[i])
        assert torch.equal(values.reshape(-1, 2, d)[untouched], old_values.reshape(-1, 2, d)[untouched])
        assert torch.equal(scales.reshape(-1, 2)[untouched].view(torch.int32),
                           old_scales.reshape(-1, 2)[untouched].view(torch.int32))


def _compare_int8(seqs, block_size, hkv, group, d, dtype, seed, window=None, soft_cap=None):
    kernel = _kernel()
    q, k, v, cache, meta, fk, fv = make_batch(seqs, block_size, hkv, group, d, dtype, seed)
    cache = to_int8_cache(cache)
    scale = d ** -0.5
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale, sliding_window=window,
                                        logits_soft_cap=soft_cap)
    if dtype == torch.float32:  # the reference is attention over the dequantized K/V
        oracle = dense_attention(q, seqs, [kv_quant.roundtrip(x) for x in fk], [kv_quant.roundtrip(x) for x in fv],
                                 scale, window, soft_cap)
        torch.testing.assert_close(ref.double(), oracle, rtol=1e-5, atol=1e-5)
    out = kernel.forward(q, k, v, cache, meta, scale, sliding_window=window, logits_soft_cap=soft_cap)
    assert torch.equal(cache, ref_cache)  # both wrote the same bytes
    assert out.dtype == dtype and out.shape == q.shape
    # bf16: the reference rounds the dequantized K/V to bf16 for SDPA, the kernel multiplies the
    # int8 values exactly; both round the output to bf16 (a few bf16 steps, as for a bf16 cache).
    diff = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert diff.max().item() <= tol


@pytest.mark.parametrize("d", [16, 24, 64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_int8_cache_matches_reference(d, dtype):
    """Vector loops (D % 16 == 0, with the 64/128 specialisations) and portable loops (24, 80);
    decodes, chunked prefills over a prefix, long prefills with and without a prefix (SDPA over
    the K/V read back from the cache, in C for the kernel backend), contexts past one
    key chunk, random block tables."""
    seqs = [(0, 1), (300, 1), (17, 1), (700, 1), (40, 20), (0, 33), (5, 150), (0, 140)]
    _compare_int8(seqs, 16, 2, 3, d, dtype, seed=d)
    _compare_int8(seqs, 5, 1, 4, d, dtype, seed=d + 1, window=70, soft_cap=30.0)


@pytest.mark.parametrize("block_size,hkv,group,seed", [(1, 1, 1, 0), (7, 3, 3, 2), (32, 1, 8, 4), (3, 8, 1, 6)])
def test_kernel_int8_cache_random_batches(block_size, hkv, group, seed):
    rng = random.Random(seed)
    seqs = _random_seqs(rng, rng.randrange(1, 9), rng.randrange(0, 4), max_ctx=600)
    _compare_int8(seqs, block_size, hkv, group, 64, torch.float32, seed)


def test_kernel_rejects_int8_cache_of_wrong_row_size():
    from pagedllm.layers.attention.cpu_backend import paged_attention

    _kernel()
    q, k, v, cache, meta, _, _ = make_batch([(3, 1), (0, 4)], 4, 2, 2, 16, torch.float32, seed=1)
    bad = torch.zeros(*cache.shape, dtype=torch.int8)  # no rows for the scales
    with pytest.raises(ValueError, match="inconsistent shapes"):
        paged_attention(torch.empty_like(q), q, bad, meta, 0.25)


def test_engine_int8_kv_cache(llama_dir):
    """Greedy ids equal between the kernel and the reference backend; the same ids (logprobs within
    tolerance) whether each prompt runs alone or all together in 48-token steps with chunked
    prefills and preemptions; logprobs near the float cache's; 3.8x the blocks of a float32 cache
    in the same memory; every block returned."""
    _kernel()
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompts = make_prompts(vocab, [1, 5, 17, 40, 96, 150, 231], seed=7)
    kw = dict(kv_cache_memory=4 << 20, enable_prefix_caching=False, device="cpu")
    by_backend = {}
    for backend in ("cpu", "torch"):
        llm = LLM(llama_dir, kv_cache_dtype="int8", attention_backend=backend, **kw)
        by_backend[backend] = [llm.generate([p], GREEDY_TOP2, use_tqdm=False)[0] for p in prompts]
        assert_pool_empty(llm)
    assert_same_greedy(by_backend["torch"], by_backend["cpu"])
    alone = by_backend["cpu"]

    f32 = LLM(llama_dir, **kw)
    i8 = LLM(llama_dir, kv_cache_dtype="int8", **kw)
    # fp32: 16 rows of 16 values (1,024 bytes a head) vs int8: 16 + 4 rows of 16 bytes (320)
    assert i8.llm_engine.config.cache_config.num_blocks == pytest.approx(
        f32.llm_engine.config.cache_config.num_blocks * 64 / 20, rel=0.01)
    assert i8.llm_engine.executor.runner.kv_caches[0].dtype == torch.int8
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    a = f32.generate([prompts[-1]], sp, use_tqdm=False)[0].prompt_logprobs[1:]
    b = i8.generate([prompts[-1]], sp, use_tqdm=False)[0].prompt_logprobs[1:]
    diffs = [abs(x[t].logprob - y[t].logprob) for t, x, y in zip(prompts[-1][1:], a, b)]
    assert 0 < sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.2
    for llm in (f32, i8):
        assert_pool_empty(llm)

    # 17 blocks of 16 tokens (one 272-token sequence), steps of <= 48 tokens.
    per_block = 2 * 2 * (16 + 4) * 2 * 16
    llm = LLM(llama_dir, kv_cache_dtype="int8", kv_cache_memory=17 * per_block, max_model_len=272,
              max_num_batched_tokens=48, enable_prefix_caching=False, device="cpu")
    assert_same_greedy(alone, llm.generate(prompts, GREEDY_TOP2, use_tqdm=False))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_empty(llm)
    short = llm.generate(prompts[:4], GREEDY_TOP2, use_tqdm=False)  # one chunk each: exactly equal
    assert _ids(short) == _ids(alone[:4])
    assert_pool_empty(llm)


def test_kv_cache_dtype_is_validated(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        LLM(llama_dir, kv_cache_dtype="fp8")
