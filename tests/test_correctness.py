"""fp32 greedy output of pagedllm equals transformers token for token, in batches that exercise
paging (block sizes 1/16/32), preemption and chunked prefill; logprobs match within 1e-4."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from conftest import assert_pool_empty, record_schedule
from pagedllm import LLM, SamplingParams

PROMPT_LENS = [1, 2, 5, 17, 40, 96, 150, 231]
MAX_TOKENS = 12
_REF_CACHE: dict = {}


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(n)] for n in lens]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with transformers' own KV cache (what ``generate`` does), returning tokens
    and their logprobs; EOS does not stop it (the engine runs with ignore_eos)."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    toks, lps = [], []
    for _ in range(n):
        lp = logits.float().log_softmax(-1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return toks, lps


def reference(model_dir: str, prompts: list[list[int]], n: int = MAX_TOKENS):
    key = (model_dir, tuple(map(tuple, prompts)), n)
    if key not in _REF_CACHE:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _REF_CACHE[key] = [hf_greedy(model, p, n) for p in prompts]
    return _REF_CACHE[key]


def greedy(n: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


def test_greedy_matches_transformers_batch(model_dir):
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = make_prompts(vocab)
    ref = reference(model_dir, prompts)
    llm = LLM(model_dir, kv_cache_memory=4 << 20, block_size=16)
    outs = llm.generate(prompts, greedy(logprobs=0), use_tqdm=False)
    for (ref_toks, ref_lps), out in zip(ref, outs):
        comp = out.outputs[0]
        assert comp.token_ids == ref_toks
        assert comp.finish_reason == "length"
        lps = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
        assert comp.cumulative_logprob == pytest.approx(sum(ref_lps), abs=1e-3)
    assert_pool_empty(llm)


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(llama_dir, block_size):
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompts = make_prompts(vocab)
    ref = reference(llama_dir, prompts)
    llm = LLM(llama_dir, kv_cache_memory=4 << 20, block_size=block_size)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref]
    assert_pool_empty(llm)


def test_preemption_keeps_greedy_output(llama_dir):
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompts = make_prompts(vocab)
    ref = reference(llama_dir, prompts, n=40)
    # Exactly 17 blocks of 16 tokens: one 272-token sequence, far less than the batch needs.
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V x layers x block x kv heads x head_dim x fp32
    llm = LLM(llama_dir, kv_cache_memory=17 * bytes_per_block, max_model_len=272, enable_prefix_caching=False)
    assert llm.llm_engine.config.cache_config.num_blocks == 17
    outs = llm.generate(prompts, greedy(n=40), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref]
    assert_pool_empty(llm)


def test_chunked_prefill(llama_dir, monkeypatch):
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompts = make_prompts(vocab)
    ref = reference(llama_dir, prompts)
    llm = LLM(llama_dir, kv_cache_memory=4 << 20, max_num_batched_tokens=48)
    log = record_schedule(llm, monkeypatch)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks = [n for rid, done, n, prompt in log if rid == outs[longest].request_id and n > 1 and done + n <= prompt]
    assert len(chunks) >= 4 and max(chunks) <= 48  # 231 tokens in chunks of <= 48
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref]
    assert_pool_empty(llm)


def test_prompt_logprobs_match_transformers(llama_dir):
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompt = make_prompts(vocab, [60], seed=3)[0]
    llm = LLM(llama_dir, kv_cache_memory=4 << 20, max_num_batched_tokens=32)  # prompt in 2 chunks
    out = llm.generate([prompt], greedy(n=1, prompt_logprobs=2), use_tqdm=False)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        top = int(ref[pos - 1].argmax())
        assert entry[top].rank == 1
    assert_pool_empty(llm)
