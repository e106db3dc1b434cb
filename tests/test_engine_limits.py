"""Engine-side limits of issue 13: ``max_num_seqs`` counts every sample of an ``n`` > 1 request,
and ``min_tokens`` holds back stop strings as it holds back EOS and stop token ids."""
from __future__ import annotations

import pytest

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams


def _record_running(llm, monkeypatch) -> list[int]:
    """Sequences holding a running slot, recorded after every schedule() and every update."""
    sched = llm.llm_engine.scheduler
    counts: list[int] = []
    real_schedule, real_update = sched.schedule, sched.update_from_output

    def schedule():
        out = real_schedule()
        counts.append(sched.num_running_seqs())
        return out

    def update(out, sampled, *tokens):
        updated = real_update(out, sampled, *tokens)
        counts.append(len(sched.running))
        return updated

    monkeypatch.setattr(sched, "schedule", schedule)
    monkeypatch.setattr(sched, "update_from_output", update)
    return counts


def test_max_num_seqs_counts_every_sample_of_n(llama_dir, monkeypatch):
    # A storm of n=3 requests with prompts prefilled in several chunks: leaders admitted while
    # earlier leaders are still prefilling used to let their siblings overshoot the cap.
    cap = 8
    llm = LLM(llama_dir, kv_cache_memory=8 << 20, max_num_seqs=cap, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    counts = _record_running(llm, monkeypatch)
    prompts = [[5 + (i * 7 + j) % 400 for j in range(40 + i)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3] * 12
    assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    assert max(counts) <= cap, f"{max(counts)} sequences ran under max_num_seqs={cap}"
    assert max(counts) >= cap - 2  # the cap is used, not just respected
    assert_pool_empty(llm)


def test_n_above_max_num_seqs_is_refused(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory=4 << 20, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([[5, 6, 7]], SamplingParams(n=5, max_tokens=2), use_tqdm=False)
    assert_pool_empty(llm)


def test_min_tokens_holds_back_stop_strings(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory=4 << 20)
    prompt = [5, 9, 17, 33, 65, 129]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    first = free.outputs[0]
    tok = llm.get_tokenizer()
    second_text = tok.decode(first.token_ids[1:2])
    stop = second_text.strip()[:2] or second_text[:1]  # text inside the 2nd token: matches early
    assert stop and stop in first.text
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                 min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 8
    assert held.token_ids[:8] == first.token_ids[:8]
    assert held.text.startswith(tok.decode(first.token_ids[:7]))  # text under min_tokens is kept whole
    if held.finish_reason == "stop":  # a later match is allowed, past min_tokens only
        assert held.stop_reason == stop
    assert_pool_empty(llm)
