"""Automatic prefix caching and copy-on-write parallel sampling."""
from __future__ import annotations

import random

import pytest

from conftest import assert_pool_empty, record_schedule
from pagedllm import LLM, SamplingParams

BS = 16
SYSTEM = [random.Random(5).randrange(6, 400) for _ in range(150)]  # a long shared "system prompt"


def questions(k: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(6, 400) for _ in range(rng.randint(3, 12))] for _ in range(k)]


def greedy(n=10, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_outputs_equal_with_and_without_caching(llama_dir):
    prompts = questions(6)
    off = LLM(llama_dir, kv_cache_memory=4 << 20, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, greedy(), use_tqdm=False)]
    on = LLM(llama_dir, kv_cache_memory=4 << 20)
    first = on.generate(prompts[:1], greedy(), use_tqdm=False)  # warm the cache
    outs = on.generate(prompts, greedy(), use_tqdm=False)
    assert first[0].outputs[0].token_ids == ref[0]
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.num_cached_tokens == (len(SYSTEM) // BS) * BS for o in outs)
    stats = on.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 6 * (len(SYSTEM) // BS) * BS
    assert stats.prefix_cache_queries == len(prompts[0]) + sum(map(len, prompts))
    assert_pool_empty(off)
    assert_pool_empty(on)


def test_second_request_computes_only_uncached_tokens(llama_dir, monkeypatch):
    llm = LLM(llama_dir, kv_cache_memory=4 << 20)
    log = record_schedule(llm, monkeypatch)
    a, b = questions(2, seed=1)
    llm.generate([a], greedy(n=4), use_tqdm=False)
    out = llm.generate([b], greedy(n=4), use_tqdm=False)[0]
    cached = (len(SYSTEM) // BS) * BS
    assert out.num_cached_tokens == cached
    # Prompt tokens after the cache hit, plus one decode step per generated token after the first.
    assert sum(n for rid, _, n, _ in log if rid == out.request_id) == (len(b) - cached) + (4 - 1)
    assert_pool_empty(llm)


def test_prompt_tokens_total_counts_whole_prompts(llama_dir):
    """pagedllm:prompt_tokens_total counts each request's whole prompt once, cached tokens included
    (as vLLM's counter): the second request's prefix comes from the cache and still counts; an n = 3
    request counts its prompt once."""
    llm = LLM(llama_dir, kv_cache_memory=4 << 20)
    engine = llm.llm_engine
    a, b = questions(2, seed=1)
    llm.generate([a], greedy(n=4), use_tqdm=False)
    assert engine.num_prompt_tokens_total == len(a)
    out = llm.generate([b], greedy(n=4), use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and engine.num_prompt_tokens_total == len(a) + len(b)
    llm.generate([a], SamplingParams(n=3, temperature=1.0, max_tokens=3, seed=1), use_tqdm=False)
    assert engine.num_prompt_tokens_total == 2 * len(a) + len(b)
    assert_pool_empty(llm)


def _peak_blocks(llm, prompts, params) -> int:
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    pool = engine.kv_cache_manager.block_pool
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, pool.num_blocks - pool.get_num_free_blocks())
    assert ids
    return peak


def test_parallel_sampling_shares_prompt_blocks(llama_dir):
    prompt = questions(1, seed=2)[0]
    llm = LLM(llama_dir, kv_cache_memory=4 << 20, enable_prefix_caching=False)
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    peak_n4 = _peak_blocks(llm, [prompt], sp)
    peak_sep = _peak_blocks(llm, [prompt] * 4, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    prompt_blocks = -(-len(prompt) // BS)
    assert peak_n4 < peak_sep
    assert peak_n4 <= prompt_blocks + 4 * 2  # shared prompt + each sample's own tail blocks
    assert_pool_empty(llm)
    # One prefill for all samples: the prompt is scheduled once.
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    single = llm.generate([prompt], greedy(n=8), use_tqdm=False)[0].outputs[0].token_ids
    assert all(o.token_ids == single for o in out[0].outputs)  # copy-on-write kept K/V intact
    assert_pool_empty(llm)


def test_eviction_under_memory_pressure_keeps_outputs_correct(llama_dir):
    rng = random.Random(9)
    prompts = [[rng.randrange(6, 400) for _ in range(100)] for _ in range(6)]
    ref_llm = LLM(llama_dir, kv_cache_memory=4 << 20, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, greedy(), use_tqdm=False)]
    # 24 blocks: room for about two 110-token sequences, so earlier prefixes get evicted.
    bytes_per_block = 2 * 2 * BS * 2 * 16 * 4
    llm = LLM(llama_dir, kv_cache_memory=24 * bytes_per_block, max_model_len=256)
    got = []
    for p in prompts + prompts[:2]:
        got.append(llm.generate([p], greedy(), use_tqdm=False)[0])
    assert [g.outputs[0].token_ids for g in got] == ref + ref[:2]
    assert got[-2].num_cached_tokens == 0  # prompts[0] was evicted by the later ones
    again = llm.generate([prompts[1]], greedy(), use_tqdm=False)[0]  # just recomputed: cached
    assert again.num_cached_tokens == (100 // BS) * BS and again.outputs[0].token_ids == ref[1]
    assert_pool_empty(llm)


def test_prompt_logprobs_bypass_the_cache(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory=4 << 20)
    p = questions(1, seed=6)[0]
    llm.generate([p], greedy(n=2), use_tqdm=False)  # cache the prefix
    out = llm.generate([p], greedy(n=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
    assert all(out.prompt_logprobs[i][p[i]] is not None for i in range(1, len(p)))
    plain = LLM(llama_dir, kv_cache_memory=4 << 20, enable_prefix_caching=False)
    ref = plain.generate([p], greedy(n=2, prompt_logprobs=1), use_tqdm=False)[0]
    for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert a[max(a, key=lambda t: a[t].logprob)].logprob == pytest.approx(
            b[max(b, key=lambda t: b[t].logprob)].logprob, abs=1e-5)
    assert_pool_empty(llm)
