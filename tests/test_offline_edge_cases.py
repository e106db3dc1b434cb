"""Edge cases of the offline API: SamplingParams validation (bad values must fail at construction,
never inside an engine step), odd prompts and conversations, and every KV block back in the pool."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=128, kv_cache_memory=1 << 20, max_num_seqs=16)


# ---- SamplingParams --------------------------------------------------------------------------
BAD_PARAMS = [
    dict(temperature=NAN), dict(temperature=INF), dict(temperature=None), dict(top_p=NAN),
    dict(min_p=NAN), dict(presence_penalty=NAN), dict(frequency_penalty=None),
    dict(repetition_penalty=NAN), dict(repetition_penalty=INF),
    dict(logprobs=1.5), dict(logprobs=True), dict(prompt_logprobs=0.5), dict(min_tokens=None),
    dict(min_tokens=2.5), dict(seed=1.5), dict(seed="1"), dict(seed=2 ** 64), dict(seed=-(2 ** 63) - 1),
    dict(seed=2 ** 64 - 1, n=2), dict(stop=[5]), dict(stop=[b"x"]), dict(stop=[None]),
    dict(stop_token_ids=["a"]), dict(n=0), dict(max_tokens=0), dict(top_k=1.5), dict(top_k=-2), dict(top_k=True), dict(stop=5),
    dict(stop=b"x"),
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=[str(k) for k in BAD_PARAMS])
def test_bad_sampling_params_raise_value_error_naming_the_field(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(next(iter(kwargs))), str(e.value)


def test_sampling_params_accept_numpy_and_edge_values():
    sp = SamplingParams(temperature=np.float32(0.5), seed=np.int64(3), logprobs=np.int64(2), min_tokens=np.int64(1))
    assert type(sp.seed) is int and type(sp.logprobs) is int and type(sp.min_tokens) is int
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1
    assert SamplingParams(seed=-(2 ** 63), n=4).seed == -(2 ** 63)
    assert SamplingParams(top_k=None).top_k == 0 and SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=np.int64(5)).top_k == 5 and type(SamplingParams(top_k=np.int64(-1)).top_k) is int


def test_extreme_seeds_and_numpy_params_generate(llm):
    params = [SamplingParams(seed=2 ** 64 - 2, n=2, max_tokens=3), SamplingParams(seed=-(2 ** 63), max_tokens=3),
              SamplingParams(seed=np.int64(7), logprobs=np.int64(1), prompt_logprobs=np.int64(1), max_tokens=3)]
    outs = llm.generate(["the king"] * 3, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1, 1]
    assert all(math.isfinite(lp.logprob) for pos in outs[2].outputs[0].logprobs for lp in pos.values())
    assert_pool_empty(llm)


# ---- prompts and conversations ----------------------------------------------------------------
@pytest.mark.parametrize("prompts", [
    ["the king", ""], ["the king", []], ["the king", [10 ** 9]], ["the king", "the " * 200],
    ["the king", {"text": "x"}], [{"prompt_token_ids": [1, -1]}]])
def test_bad_prompt_in_a_batch_raises_and_frees_everything(llm, prompts):
    with pytest.raises(ValueError):
        llm.generate(prompts, SamplingParams(max_tokens=4, n=3), use_tqdm=False)
    assert_pool_empty(llm)
    assert llm.llm_engine.output_processor.states == {}


def test_mixed_params_list_and_prompt_forms(llm):
    prompts = ["the king", [5, 6, 7], {"prompt": "romeo"}, {"prompt_token_ids": [9] * 127}]
    params = [SamplingParams(max_tokens=2, n=2, seed=1), SamplingParams(temperature=0, max_tokens=5, logprobs=2,
                                                                         prompt_logprobs=1),
              SamplingParams(max_tokens=None, ignore_eos=True, stop=["a", "ab", "abc"]), None]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1, 1, 1]
    assert len(outs[1].prompt_logprobs) == 3 and len(outs[1].outputs[0].logprobs) == 5
    assert len(outs[3].outputs[0].token_ids) == 1  # 127 + 1 = max_model_len
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert llm.generate([], use_tqdm=False) == []
    assert_pool_empty(llm)


def test_chat_odd_messages(llm):
    sp = SamplingParams(max_tokens=2)
    convs = [[{"role": "user", "content": None}], [{"role": "user"}],
             [{"role": "system", "content": ""}, {"role": "assistant", "content": "\U0001f600"}]]
    outs = llm.chat(convs, sp, use_tqdm=False)
    assert len(outs) == 3 and all(o.finished for o in outs)
    assert llm.chat([], sp, use_tqdm=False) == []
    # an image part on a text-only model is refused (it was dropped silently before images were served)
    image = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "x"}]}]
    for bad in ([[]], [{"role": "user", "content": "the " * 300}], image):
        with pytest.raises(ValueError):
            llm.chat(bad, sp, use_tqdm=False)
    # a message without a role, or with content of another type: ValueErrors naming the message
    for bad, match in (([{"content": "hi"}], r"messages\[0\] must be a dict with a string 'role'"),
                       ([{"role": "user", "content": "a"}, {"role": 5}], r"messages\[1\] must be a dict"),
                       ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string")):
        with pytest.raises(ValueError, match=match):
            llm.chat(bad, sp, use_tqdm=False)
    assert_pool_empty(llm)


def test_chat_rejects_a_bare_string(llama_dir):
    from pagedllm import LLM

    llm = LLM(llama_dir, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="messages"):
        llm.chat("hi")


def test_priority_scheduling_offline(llama_dir):
    """LLM(scheduling_policy="priority").generate(..., priority=[...]): outputs equal the FCFS
    engine's (the order of work changes, not what is computed); in a cache that holds one sequence at
    a time, the most urgent request is admitted first and finishes first. Under FCFS a priority is a
    ValueError."""
    from pagedllm import LLM, SamplingParams

    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    fcfs = LLM(llama_dir, kv_cache_memory=1 << 20, max_model_len=32)
    expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, sp, use_tqdm=False)]
    with pytest.raises(ValueError, match="needs the priority scheduling policy"):
        fcfs.generate(prompts, sp, priority=[0, 1, 0, 0], use_tqdm=False)
    # 2 blocks of 16: one sequence of 25 tokens at a time
    llm = LLM(llama_dir, kv_cache_memory=2 * fcfs.llm_engine.executor.bytes_per_block(), block_size=16,
              max_model_len=32, scheduling_policy="priority")
    assert llm.llm_engine.config.cache_config.num_blocks == 2
    import numpy as np
    outs = llm.generate(prompts, sp, priority=[3, 0, np.int64(2), -1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    done = sorted(range(4), key=lambda i: outs[i].metrics.finished_time)
    assert done == [3, 1, 2, 0]
    with pytest.raises(ValueError, match="got 2 priorities for 4 prompts"):
        llm.generate(prompts, sp, priority=[0, 1], use_tqdm=False)
    with pytest.raises(ValueError, match="priority must be an integer, got True"):
        llm.generate(prompts, sp, priority=[True, 0, 0, 0], use_tqdm=False)
    assert_pool_empty(llm)
