"""Blocks behind a sliding window go back to the pool while a request runs (a window on every
layer: Mistral, StarCoder2, Phi-3), their block-table entries pointing to the null block; output
stays transformers' token for token, and a pool too small for one whole sequence serves them."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.engine.block_pool import ROOT_HASH, hash_block_tokens
from pagedllm.engine.kv_cache_manager import KVCacheManager, max_blocks_per_seq
from test_block_pool_scheduler import make_req
from test_correctness import hf_greedy, make_prompts

W, BS = 6, 4


def held(kv: KVCacheManager, rid: str) -> list[int]:
    """Indexes of the blocks of ``rid``'s table that are not the null block."""
    return [i for i, b in enumerate(kv.req_to_blocks[rid]) if b is not kv.null_block]


def visible_blocks(num_computed: int, num_new: int) -> list[int]:
    """Block indexes holding a position that a query at num_computed .. num_computed + num_new - 1 sees."""
    first = max(0, num_computed - W + 1)
    return list(range(first // BS, (num_computed + num_new - 1) // BS + 1))


def test_decode_frees_each_block_once_it_leaves_the_window():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False, sliding_window=W)
    assert kv.null_block is not None and kv.block_pool.get_num_free_blocks() == 15
    req = make_req("a", 10, max_tokens=30)
    assert kv.allocate_slots(req, 10)
    assert held(kv, "a") == [0, 1, 2]
    req.num_computed_tokens = 10
    bound = max_blocks_per_seq(4096, BS, W, 1)
    assert bound == 3
    for step in range(30):
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1)
        c = req.num_computed_tokens
        assert held(kv, "a") == visible_blocks(c, 1), step
        assert len(held(kv, "a")) <= bound
        assert len(kv.get_block_ids("a")) == -(-(c + 1) // BS)  # the table still spans every position
        assert kv.block_pool.get_num_free_blocks() == 15 - len(held(kv, "a"))
        req.num_computed_tokens += 1
    assert kv.null_block.ref_cnt == 1
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks == 15
    assert kv.usage == 0.0


def test_prompt_chunks_hold_only_window_and_chunk():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False, sliding_window=W)
    req = make_req("a", 50)
    chunk = 8
    for start in range(0, 50, chunk):
        n = min(chunk, 50 - start)
        assert kv.allocate_slots(req, n)
        assert held(kv, "a") == visible_blocks(start, n)
        assert len(held(kv, "a")) <= max_blocks_per_seq(4096, BS, W, chunk)
        req.num_computed_tokens += n
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == 15


def test_prefix_hits_behind_the_window_are_not_taken():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=W)
    a = make_req("a", 20)
    assert kv.allocate_slots(a, 20)
    a_blocks = list(kv.req_to_blocks["a"])
    kv.free(a)  # its 5 full blocks stay cached in the free queue
    assert kv.block_pool.num_cached_free_blocks == 5
    b = make_req("b", 24)  # same first 20 tokens
    hits, n = kv.get_computed_blocks(b)
    assert n == 20 and hits == [kv.null_block] * 3 + a_blocks[3:5]  # found from the right
    assert kv.allocate_slots(b, 4, hits)
    # Queries from position 20 on see positions >= 15: blocks 0-2 are behind the window, and a
    # list of the hits themselves takes none of them either.
    assert kv.allocate_slots(make_req("b2", 24), 4, a_blocks)
    assert kv.req_to_blocks["b2"][:3] == [kv.null_block] * 3
    kv.free(make_req("b2", 24))
    assert kv.req_to_blocks["b"][:3] == [kv.null_block] * 3
    assert kv.req_to_blocks["b"][3:5] == a_blocks[3:5] and [x.ref_cnt for x in a_blocks[3:5]] == [1, 1]
    assert all(x.ref_cnt == 0 and kv.block_pool.get_cached_block(x.block_hash) is x for x in a_blocks[:3])
    assert kv.null_block.block_hash is None
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 15 and kv.null_block.ref_cnt == 1


def test_prefix_hit_needs_only_the_window_blocks():
    """Blocks freed behind the window go back first, so a prefix's leading blocks are evicted
    first; a later request with the prefix still hits the blocks its window sees."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=W)
    a = make_req("a", 24)
    for n in (8, 8, 8):  # the third chunk frees blocks 0 and 1 (positions < 16 - W + 1)
        assert kv.allocate_slots(a, n)
        a.num_computed_tokens += n
    a_blocks = [b for b in kv.req_to_blocks["a"] if b is not kv.null_block]
    kv.free(a)
    c = make_req("c", 28, first=100)
    assert kv.allocate_slots(c, 28)  # 7 blocks: the 5 never used, then a's blocks 0 and 1
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is None
    b = make_req("b", 25)  # a's 24 tokens and one more
    hits, n = kv.get_computed_blocks(b)
    # A query at position 24 sees positions >= 19: blocks 4 and 5, both still cached.
    assert n == 24 and hits == [kv.null_block] * 4 + a_blocks[2:4]
    assert kv.allocate_slots(b, 1, hits)
    assert kv.req_to_blocks["b"][4:6] == a_blocks[2:4] and len(held(kv, "b")) == 3
    kv.free(b)
    kv.free(c)
    assert kv.block_pool.get_num_free_blocks() == 11


def test_forked_samples_free_their_shared_blocks_once():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False, sliding_window=W)
    a, b = make_req("a", 9, max_tokens=20), make_req("b", 9, max_tokens=20)
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = b.num_computed_tokens = 9
    a.append_output_token(1)
    b.append_output_token(2)
    kv.fork(a, b)
    for _ in range(12):
        for r in (a, b):
            assert kv.allocate_slots(r, 1)
            assert held(kv, r.request_id) == visible_blocks(r.num_computed_tokens, 1)
            r.num_computed_tokens += 1
            r.append_output_token(3)
    kv.take_pending_copies()
    assert kv.null_block.ref_cnt == 1
    kv.free(a)
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 15
    assert all(x.ref_cnt == 0 for x in kv.block_pool.blocks if x is not kv.null_block)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    # Wide enough for the CPU layer runner (test_cpu_layer_runner.WIDE): "auto" runs it.
    return build_checkpoint(str(tmp_path_factory.mktemp("mistral_sw")), "mistral", seed=5, sliding_window=16,
                            hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2)


def _bytes_per_block(cfg) -> int:
    """float32 K and V of one block in every layer."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * BS * cfg.num_key_value_heads * head_dim * 4


def _reference(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, n)[0] for p in prompts]


def _watch_tables(llm) -> list[int]:
    """Record, after every schedule(), the most non-null blocks any one request holds."""
    kv, sched = llm.llm_engine.kv_cache_manager, llm.llm_engine.scheduler
    peaks: list[int] = []
    schedule = sched.schedule

    def watched():
        out = schedule()
        peaks.append(max((sum(b is not kv.null_block for b in t) for t in kv.req_to_blocks.values()), default=0))
        return out

    sched.schedule = watched
    return peaks


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_pool_smaller_than_one_sequence_serves_window_models(mistral_dir, backend):
    """14 blocks of 4 tokens (one is the null block) serve 4 requests of up to 110 tokens, with
    chunked prefill and preemption (a decoding request holds 5 blocks); the torch backend (the
    CUDA path) reads null-block entries masked, the CPU kernel and layer runner skip them."""
    cfg = transformers.AutoConfig.from_pretrained(mistral_dir)
    prompts = make_prompts(cfg.vocab_size, [3, 30, 70, 45], seed=6)
    n = 40
    llm = LLM(mistral_dir, kv_cache_memory=14 * _bytes_per_block(cfg), block_size=BS, max_num_batched_tokens=16,
              max_model_len=1024, attention_backend=backend)
    cc = llm.llm_engine.config.cache_config
    assert (cc.sliding_window, cc.num_blocks) == (16, 14)
    peaks = _watch_tables(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _reference(mistral_dir, prompts, n)
    assert max(peaks) <= max_blocks_per_seq(1024, BS, 16, 16) == 9
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


def test_parallel_samples_and_prefix_hits_past_the_window(mistral_dir):
    """n=2 samples share the prompt's blocks; a second request with the same 64-token prefix hits
    the cache (its blocks behind the window taken as null entries)."""
    cfg = transformers.AutoConfig.from_pretrained(mistral_dir)
    prompts = make_prompts(cfg.vocab_size, [64], seed=7)
    longer = [prompts[0] + make_prompts(cfg.vocab_size, [9], seed=8)[0]]
    ref = _reference(mistral_dir, prompts + longer, 24)
    llm = LLM(mistral_dir, kv_cache_memory=4 << 20, block_size=BS)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    out = llm.generate(prompts, greedy, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [ref[0]] * 2
    out = llm.generate(longer, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == ref[1]
    assert_pool_empty(llm)


def test_prefix_hits_after_other_requests_evicted_the_leading_blocks(mistral_dir):
    """a (a 61-token prefix) runs, an unrelated request c takes the blocks a freed first (its
    leading ones), then b with a's prefix still hits: a query past the prefix sees only its last
    window's blocks."""
    cfg = transformers.AutoConfig.from_pretrained(mistral_dir)
    prefix = make_prompts(cfg.vocab_size, [61], seed=11)[0]
    a, b, c = prefix + [7, 8, 9], prefix + [10, 11, 12], make_prompts(cfg.vocab_size, [30], seed=12)[0]
    llm = LLM(mistral_dir, kv_cache_memory=40 * _bytes_per_block(cfg), block_size=BS, max_model_len=128,
              max_num_batched_tokens=16)
    # c allocates 23 blocks one after another: the 18 a never used, then the 5 a freed first.
    outs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
            for p, n in ((a, 20), (c, 60), (b, 20))]
    assert llm.llm_engine.kv_cache_manager.block_pool.get_cached_block(hash_block_tokens(ROOT_HASH, a[:BS])) is None
    assert outs[2].num_cached_tokens == 60
    assert [o.outputs[0].token_ids for o in outs] == [_reference(mistral_dir, [p], n)[0]
                                                      for p, n in ((a, 20), (c, 60), (b, 20))]
    assert_pool_empty(llm)


def test_hybrid_windows_keep_every_block(tmp_path):
    """Qwen2 with a global layer 0 and a sliding layer 1: a global layer needs every position."""
    d = build_checkpoint(str(tmp_path), "qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1)
    llm = LLM(d, kv_cache_memory=1 << 20, block_size=BS)
    assert llm.llm_engine.config.cache_config.sliding_window is None
    assert llm.llm_engine.kv_cache_manager.null_block is None


def test_pipeline_stages_report_their_windows(mistral_dir):
    cfg = transformers.AutoConfig.from_pretrained(mistral_dir)
    prompts = make_prompts(cfg.vocab_size, [50], seed=9)
    llm = LLM(mistral_dir, kv_cache_memory=4 << 20, block_size=BS, pipeline_parallel_size=2)
    try:
        assert llm.llm_engine.config.cache_config.sliding_window == 16
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == _reference(mistral_dir, prompts, 20)[0]
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()


def test_pool_of_exactly_one_sequence_keeps_every_block(mistral_dir):
    """16 blocks hold one 64-token sequence but not also the null block: no freeing, still served."""
    cfg = transformers.AutoConfig.from_pretrained(mistral_dir)
    prompts = make_prompts(cfg.vocab_size, [40], seed=10)
    llm = LLM(mistral_dir, kv_cache_memory=16 * _bytes_per_block(cfg), block_size=BS, max_model_len=64)
    assert llm.llm_engine.config.cache_config.sliding_window is None and llm.llm_engine.kv_cache_manager.null_block is None
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _reference(mistral_dir, prompts, 24)[0]
    assert_pool_empty(llm)
