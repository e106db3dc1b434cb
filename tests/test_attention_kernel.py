"""Paged attention backends on randomized paged batches: the torch reference equals a dense
attention written from the definitions (transformers' causal + sliding-window masks, Gemma 2's soft
cap), and the compiled CPU kernel equals the torch reference, on random block tables, block sizes
1-32, GQA ratios 1-8, contexts up to 4,096 tokens, decodes and chunked prefills in one batch."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from pagedllm.layers.attention import AttentionMetadata, TorchPagedAttention, get_attention_backend, write_kv
from pagedllm.layers.attention.cpu_backend import paged_attention


def make_batch(seqs: list[tuple[int, int]], block_size: int, hkv: int, group: int, d: int, dtype, seed: int):
    """seqs: (cached prefix length, new tokens) per sequence, decodes (new == 1) first.

    Returns (q, k, v, kv_cache, meta, full_k, full_v): the cache holds every prefix at random
    physical blocks; k/v are the new tokens' K/V (the backend writes them); full_k/full_v are
    each sequence's whole K/V [L, Hkv, D] for a dense oracle."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + len(seqs) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    tables, slot_mapping, full_k, full_v, ks, vs = [], [], [], [], [], []
    for (c, n), nb in zip(seqs, need):
        table = [perm.pop() for _ in range(nb + rng.randrange(2))]  # sometimes a spare block at the end
        tables.append(table)
        fk = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        fv = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(c + n)]
        kv_cache[0].view(-1, hkv, d)[slots[:c]] = fk[:c]
        kv_cache[1].view(-1, hkv, d)[slots[:c]] = fv[:c]
        slot_mapping += slots[c:]
        full_k.append(fk)
        full_v.append(fv)
        ks.append(fk[c:])
        vs.append(fv[c:])
    n_tok = sum(n for _, n in seqs)
    q = torch.randn(n_tok, hkv * group, d, generator=g).to(dtype)
    meta = AttentionMetadata.build(torch.tensor(slot_mapping), tables, [c + n for c, n in seqs],
                                   [n for _, n in seqs], block_size, "cpu")
    return q, torch.cat(ks), torch.cat(vs), kv_cache, meta, full_k, full_v


def dense_attention(q, seqs, full_k, full_v, scale, window=None, soft_cap=None, sinks=None, chunk=None):
    """Per sequence and head, from the definitions, in float64; ``sinks`` [H]: one more logit per
    head in the softmax, with no value (transformers' gpt-oss eager_attention_forward)."""
    out, row = [], 0
    for (c, n), fk, fv in zip(seqs, full_k, full_v):
        qs = q[row:row + n].double()  # [n, H, D]
        row += n
        group = qs.shape[1] // fk.shape[1]
        kk = fk.double().repeat_interleave(group, dim=1)  # [L, H, D]
        vv = fv.double().repeat_interleave(group, dim=1)
        s = torch.einsum("thd,lhd->htl", qs, kk) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        q_pos = torch.arange(c, c + n).view(n, 1)
        k_pos = torch.arange(c + n).view(1, -1)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window  # transformers' sliding_window_overlay
        if chunk is not None:
            visible &= k_pos // chunk == q_pos // chunk  # transformers' chunked_overlay
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, n, 1)], -1)
        p = s.softmax(-1)[..., :fk.shape[0]]
        out.append(torch.einsum("htl,lhd->thd", p, vv))
    return torch.cat(out)


MIXED = [(0, 1), (5, 1), (40, 1), (17, 30), (0, 45), (64, 3)]


@pytest.mark.parametrize("window,soft_cap", [(None, None), (8, None), (None, 5.0), (20, 30.0), (1, None)])
@pytest.mark.parametrize("block_size,hkv,group", [(1, 2, 1), (16, 1, 4), (5, 2, 3)])
def test_reference_matches_dense_definition(window, soft_cap, block_size, hkv, group):
    d = 16
    q, k, v, cache, meta, fk, fv = make_batch(MIXED, block_size, hkv, group, d, torch.float32, seed=block_size)
    scale = d ** -0.5
    out = TorchPagedAttention().forward(q, k, v, cache, meta, scale, sliding_window=window,
                                        logits_soft_cap=soft_cap)
    ref = dense_attention(q, MIXED, fk, fv, scale, window, soft_cap)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (8, 5.0)])
@pytest.mark.parametrize("block_size,hkv,group", [(1, 2, 1), (5, 2, 3)])
def test_reference_attention_sinks_match_dense_definition(window, soft_cap, block_size, hkv, group):
    """gpt-oss's attention sinks: each head's sink logit joins the softmax; with and without a cache."""
    d = 16
    q, k, v, cache, meta, fk, fv = make_batch(MIXED, block_size, hkv, group, d, torch.float32, seed=block_size)
    sinks = torch.randn(hkv * group, generator=torch.Generator().manual_seed(4)) * 2
    out = TorchPagedAttention().forward(q, k, v, cache, meta, 0.25, sliding_window=window, logits_soft_cap=soft_cap,
                                        sinks=sinks)
    ref = dense_attention(q, MIXED, fk, fv, 0.25, window, soft_cap, sinks)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref, dense_attention(q, MIXED, fk, fv, 0.25, window, soft_cap), atol=1e-3)
    seqs = [(0, 7), (0, 12)]
    q, k, v, _, meta, fk, fv = make_batch(seqs, 4, hkv, group, 8, torch.float32, seed=3)
    out = TorchPagedAttention().forward(q, k, v, None, meta, 0.3, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), dense_attention(q, seqs, fk, fv, 0.3, window, None, sinks),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 16, 40])
def test_reference_chunked_attention_matches_dense_definition(chunk):
    """Llama 4's chunked attention: keys in the query's own chunk of positions."""
    q, k, v, cache, meta, fk, fv = make_batch(MIXED, 5, 2, 3, 16, torch.float32, seed=chunk)
    out = TorchPagedAttention().forward(q, k, v, cache, meta, 0.25, attention_chunk=chunk)
    torch.testing.assert_close(out.double(), dense_attention(q, MIXED, fk, fv, 0.25, chunk=chunk), rtol=1e-5, atol=1e-5)
    seqs = [(0, 30)]
    q, k, v, _, meta, fk, fv = make_batch(seqs, 4, 2, 2, 8, torch.float32, seed=3)
    out = TorchPagedAttention().forward(q, k, v, None, meta, 0.3, attention_chunk=chunk)
    torch.testing.assert_close(out.double(), dense_attention(q, seqs, fk, fv, 0.3, chunk=chunk), rtol=1e-5, atol=1e-5)


def test_reference_without_cache_is_causal_attention():
    """The profiling pass (no KV cache) runs prompts from the batch's own K/V."""
    seqs = [(0, 7), (0, 12)]
    q, k, v, _, meta, fk, fv = make_batch(seqs, 4, 2, 2, 8, torch.float32, seed=3)
    for window, cap in [(None, None), (3, 2.0)]:
        out = TorchPagedAttention().forward(q, k, v, None, meta, 0.3, sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(out.double(), dense_attention(q, seqs, fk, fv, 0.3, window, cap),
                                   rtol=1e-5, atol=1e-5)


def test_selector_names_and_refusals():
    assert isinstance(get_attention_backend("torch", device="cpu", dtype=torch.float32, head_dim=64, block_size=16),
                      TorchPagedAttention)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attention_backend("flash", device="cpu", dtype=torch.float32, head_dim=64, block_size=16)


# ---- the compiled CPU kernel against the reference ----

def _kernel():
    from pagedllm.layers.attention.cpu_backend import CpuPagedAttention, load_kernel

    lib, err = load_kernel()
    if lib is None:
        pytest.skip(f"cpu paged-attention kernel cannot be built here: {err}")
    return CpuPagedAttention()


def _random_seqs(rng: random.Random, n_decode: int, n_prefill: int, max_ctx: int) -> list[tuple[int, int]]:
    decodes = [(rng.randrange(0, max_ctx), 1) for _ in range(n_decode)]
    prefills = [(rng.choice([0, rng.randrange(0, max_ctx)]), rng.randrange(2, 40)) for _ in range(n_prefill)]
    return decodes + prefills


def _compare(seqs, block_size, hkv, group, d, dtype, seed, window=None, soft_cap=None, tol=1e-5, sinks=False,
             chunk=None):
    kernel = _kernel()
    q, k, v, cache, meta, _, _ = make_batch(seqs, block_size, hkv, group, d, dtype, seed)
    scale = d ** -0.5
    sink_logits = torch.randn(hkv * group, generator=torch.Generator().manual_seed(seed)) * 3 if sinks else None
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale, sliding_window=window,
                                        logits_soft_cap=soft_cap, sinks=sink_logits, attention_chunk=chunk)
    # The kernel alone on every sequence (the backend sends long prefill chunks to the reference).
    write_kv(k, v, cache, meta.slot_mapping)
    out = paged_attention(torch.empty_like(q), q, cache, meta, scale, window, soft_cap, sinks=sink_logits,
                          attention_chunk=chunk)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(cache, ref_cache)  # both wrote the new K/V to the same slots
    # Relative error of each output row (one query, one head), the largest over the batch: both
    # are ~6e-7 from a float64 oracle in fp32 (an element-wise ratio is noise near zero).
    diff = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    err = diff.max().item()
    assert err <= tol, f"max row relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("block_size,hkv,group,seed", [
    (1, 1, 1, 0), (2, 2, 8, 1), (7, 3, 3, 2), (16, 2, 4, 3), (32, 1, 5, 4), (16, 4, 2, 5), (3, 8, 1, 6)])
def test_kernel_matches_reference_mixed_batch(block_size, hkv, group, seed):
    """Randomized block tables; decodes and chunked prefills (with and without a cached prefix)."""
    rng = random.Random(seed)
    seqs = _random_seqs(rng, rng.randrange(1, 9), rng.randrange(0, 4), max_ctx=200)
    _compare(seqs, block_size, hkv, group, d=32, dtype=torch.float32, seed=seed)


@pytest.mark.parametrize("window,soft_cap", [(16, None), (None, 20.0), (33, 50.0), (1, None)])
def test_kernel_sliding_window_and_soft_cap(window, soft_cap):
    rng = random.Random(7)
    seqs = _random_seqs(rng, 6, 3, max_ctx=120)
    _compare(seqs, 8, 2, 3, d=64, dtype=torch.float32, seed=11, window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("d,dtype", [(64, torch.float32), (24, torch.float32), (64, torch.bfloat16)])
def test_kernel_attention_sinks(d, dtype):
    """gpt-oss's sinks in the vector loops (d 64), the portable ones (d 24) and bf16; a split long
    decode (its parts merged, then the sink); a window and a soft cap beside them."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rng = random.Random(13)
    _compare(_random_seqs(rng, 6, 3, max_ctx=200), 16, 2, 4, d=d, dtype=dtype, seed=13, tol=tol, sinks=True)
    _compare(MIXED, 5, 2, 3, d=d, dtype=dtype, seed=14, window=20, soft_cap=30.0, tol=tol, sinks=True)
    _compare([(3000, 1)], 16, 1, 3, d=d, dtype=dtype, seed=15, tol=tol, sinks=True)


@pytest.mark.parametrize("d,dtype", [(64, torch.float32), (24, torch.float32), (64, torch.bfloat16)])
def test_kernel_chunked_attention(d, dtype):
    """Chunks of 1, 7 and 16 positions (a negative window to the kernel) in the vector and portable
    loops, decodes and prefill chunks that cross chunk boundaries; a split long decode."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rng = random.Random(17)
    for chunk in (1, 7, 16):
        _compare(_random_seqs(rng, 6, 3, max_ctx=120), 16, 2, 3, d=d, dtype=dtype, seed=chunk, tol=tol, chunk=chunk)
    _compare([(3000, 1), (2100, 1)], 16, 1, 3, d=d, dtype=dtype, seed=5, tol=tol, chunk=1024)


def test_kernel_long_contexts():
    """Contexts from 1 to 4,096 tokens, a 1,000-token prefill over a 3,000-token prefix."""
    seqs = [(0, 1), (4095, 1), (2047, 1), (3000, 1000), (0, 300)]
    _compare(seqs, 16, 2, 4, d=64, dtype=torch.float32, seed=5)
    _compare(seqs[:3], 32, 1, 8, d=128, dtype=torch.float32, seed=6, window=512)


@pytest.mark.parametrize("seqs,hkv,window,soft_cap", [
    ([(3000, 1)], 1, None, None), ([(3000, 1)], 1, 1200, 30.0), ([(1500, 1), (800, 1)], 1, None, None),
    ([(2047, 1), (511, 1), (40, 1)], 1, 1000, None)])
def test_kernel_splits_few_long_decodes(seqs, hkv, window, soft_cap):
    """Fewer decode items than 2 a thread: each long decode's keys are split into parts of at least
    256 (one thread each), merged by their running maxima and sums (flash-decoding); a window that
    spans parts, and one that leaves a part empty (a part with no visible key)."""
    _compare(seqs, 16, hkv, 3, d=64, dtype=torch.float32, seed=9, window=window, soft_cap=soft_cap)
    _compare(seqs, 16, hkv, 3, d=64, dtype=torch.bfloat16, seed=9, window=window, soft_cap=soft_cap, tol=2e-2)


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 100)])
def test_kernel_whole_sequence_decodes_over_many_chunks(dtype, window):
    """Enough decodes that each work item takes all KV heads of a sequence (>= 4 per thread), with
    contexts of up to 1,500 tokens: many of the vector path's chunks (on AVX2 each read first into
    L2, 80 keys a chunk at SmolLM2's shape), with prefills in the same batch."""
    rng = random.Random(21)
    seqs = [(rng.randrange(0, 1500), 1) for _ in range(4 * torch.get_num_threads() + 4)] + [(700, 37), (0, 90)]
    _compare(seqs, 16, 3, 3, d=64, dtype=dtype, seed=21, window=window, tol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (24, 30.0)])
def test_kernel_bf16(window, soft_cap):
    """bf16 q and cache, fp32 accumulation. The reference runs SDPA in bf16 and both round the output
    to bf16 (relative step 2^-8), so the bound is a few bf16 steps: 2e-2."""
    rng = random.Random(9)
    seqs = _random_seqs(rng, 5, 2, max_ctx=150)
    _compare(seqs, 16, 3, 3, d=64, dtype=torch.bfloat16, seed=9, window=window, soft_cap=soft_cap, tol=2e-2)


@pytest.mark.parametrize("d", [16, 24, 32, 48, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_head_dims(d, dtype):
    """Every code path of the kernel: head sizes that are not a multiple of 16 (portable loops), a
    runtime multiple of 16 (vector loops), and the compile-time 16/32/64/128 specialisations (vector
    loops with register accumulators); decodes, a chunk over a prefix, contexts past one key chunk."""
    seqs = [(0, 1), (300, 1), (17, 1), (600, 1), (40, 20), (0, 33)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _compare(seqs, 16, 2, 3, d=d, dtype=dtype, seed=d, tol=tol)
    _compare(seqs, 5, 1, 4, d=d, dtype=dtype, seed=d + 1, window=70, tol=tol)


@pytest.mark.parametrize("long_prefill", [None, 128])
def test_backend_routes_long_prefills(long_prefill):
    """The cpu backend: the kernel for every chunk by default; with LONG_PREFILL set, SDPA for the
    chunks over it. Both equal dense attention."""
    kernel = _kernel()
    kernel.LONG_PREFILL = long_prefill
    seqs = [(30, 1), (0, 1), (50, 129), (10, 5), (0, 256), (300, 200)]
    q, k, v, cache, meta, fk, fv = make_batch(seqs, 8, 2, 4, 32, torch.float32, seed=4)
    for window, cap in [(None, None), (40, 10.0)]:
        out = kernel.forward(q, k, v, cache.clone(), meta, 0.2, sliding_window=window, logits_soft_cap=cap)
        ref = dense_attention(q, seqs, fk, fv, 0.2, window, cap)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_layouts():
    _kernel()
    q, k, v, cache, meta, _, _ = make_batch([(3, 1), (0, 4)], 4, 2, 2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="q must be a contiguous"):
        paged_attention(torch.empty_like(q), q.transpose(0, 1), cache, meta, 0.25)
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_attention(torch.empty_like(q), q, cache, meta, 0.25)


def test_selector_auto_picks_kernel_on_cpu_and_refuses_cuda():
    _kernel()
    setup = dict(dtype=torch.float32, head_dim=64, block_size=16)
    assert get_attention_backend("auto", device="cpu", **setup).name == "cpu"
    on_cuda = "triton" if importlib.util.find_spec("triton") else "torch"  # the Triton backend where triton is
    assert get_attention_backend("auto", device="cuda", **setup).name == on_cuda
    with pytest.raises(ValueError, match="CPU tensors only"):
        get_attention_backend("cpu", device="cuda", **setup)
    with pytest.raises(ValueError, match="float16 is not float32 or bfloat16"):
        get_attention_backend("cpu", device="cpu", dtype=torch.float16, head_dim=64, block_size=16)


def test_auto_falls_back_to_reference_with_one_log_line(monkeypatch, tmp_path):
    """No compiler: the build fails with a reason, and auto logs it once and runs the reference."""
    from pagedllm.platforms.cpu import attention as cpu_kernel

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(Exception):
        cpu_kernel._build()
    monkeypatch.setattr(cpu_kernel._LIBRARY, "lib", None)
    monkeypatch.setattr(cpu_kernel._LIBRARY, "error", "RuntimeError: no C++ compiler found")
    from conftest import pagedllm_logs
    with pagedllm_logs() as records:
        backend = get_attention_backend("auto", device="cpu", dtype=torch.float32, head_dim=64, block_size=16)
    assert backend.name == "torch"
    lines = [r.getMessage() for r in records if "attention backend" in r.getMessage()]
    assert lines == ["attention backend: torch (cpu: the kernel could not be built or loaded "
                     "(RuntimeError: no C++ compiler found))"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_backends_agree(llama_dir, dtype):
    """The engine with --attention-backend cpu and torch: same greedy tokens (fp32: equal, as both
    equal transformers in test_correctness; bf16: logprobs close), pools empty again."""
    from conftest import assert_pool_empty
    from pagedllm import LLM, SamplingParams

    _kernel()
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(6, 500) for _ in range(n)]} for n in (1, 9, 40, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(llama_dir, dtype=dtype, attention_backend=backend, device="cpu", block_size=4, max_model_len=256,
                  kv_cache_memory=4 << 20, max_num_batched_tokens=64)
        assert llm.llm_engine.executor.runner.model.layers[0].self_attn.backend.name == backend
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
        assert_pool_empty(llm)
    for a, b in zip(outs["cpu"], outs["torch"]):
        if dtype == "float32":
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        n = len(la) if dtype == "float32" else 1  # bf16 may diverge after the first token
        assert la[:n] == pytest.approx(lb[:n], abs=1e-4 if dtype == "float32" else 5e-2)


@pytest.mark.parametrize("d,group,dtype", [(40, 4, torch.float32), (576, 16, torch.float32), (576, 8, torch.bfloat16)])
def test_one_plane_cache_reads_values_from_keys(d, group, dtype):
    """A cache of one plane [1, ...] (multi-head latent attention: the values are the keys) in both
    backends equals a two-plane cache whose V plane copies the K plane; one KV head of MLA's width
    (576 = 512 + 64) with 8-16 query heads; decodes, a chunk over a prefix, a split long decode."""
    kernel = _kernel()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    seqs = [(0, 1), (300, 1), (17, 1), (2000, 1), (40, 20), (0, 33)]
    q, k, _, cache, meta, _, _ = make_batch(seqs, 16, 1, group, d, dtype, seed=d + group)
    scale = d ** -0.5
    two = torch.stack([cache[0], cache[0]])
    ref = TorchPagedAttention().forward(q, k, k, two, meta, scale)
    for backend in (TorchPagedAttention(), kernel):
        one = cache[:1].clone()
        out = backend.forward(q, k, k, one, meta, scale)
        assert torch.equal(one[0], two[0])  # the new keys written once, where the two-plane cache has them
        err = ((out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max().item()
        assert err <= tol, f"{backend.name}: max row relative error {err:.2e} > {tol:.0e}"
