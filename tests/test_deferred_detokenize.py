"""Deferred detokenization (OutputProcessor.process's ``defer``): offline ``LLM.generate`` detokenizes a
request without stop strings once it finishes, not every step. Its outputs must equal, character for
character, those of the engine stepped with every request detokenized each step: multi-byte
characters split over tokens (seeded sampling over the whole vocabulary), EOS and stop token ids
(not part of the text), n > 1, logprobs, special tokens kept, requests with stop strings in the same
batch (detokenized each step), the switch back to per-step outputs, and aborts."""
from __future__ import annotations

import random

import pytest

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import OutputProcessor
from test_correctness import make_prompts


def _params(tok) -> list[SamplingParams]:
    """One of each kind of request; the sampled ones have their own seed (the same tokens in every run)."""
    eos = tok.eos_token_id
    parts = set(tok.encode("\u00e9\u65e5\u672c\u00fc", add_special_tokens=False))  # the bytes of 4 characters
    return [
        SamplingParams(temperature=1.0, seed=8, max_tokens=40, logit_bias={t: 8.0 for t in parts}, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True),  # any id: partial characters
        SamplingParams(temperature=1.0, seed=2, max_tokens=40, skip_special_tokens=False, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, n=3, logprobs=2),
        SamplingParams(temperature=1.0, seed=4, max_tokens=40, stop_token_ids=[7, 9, 11], min_tokens=3),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, logit_bias={eos: 4.0}),  # finishes on EOS
        SamplingParams(temperature=1.0, seed=6, max_tokens=40, stop=["a", "e"], ignore_eos=True),  # per step
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, stop=["o"], include_stop_str_in_output=True,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]


def _outputs(o) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
            for c in o.outputs]


def _requests(llm) -> list[tuple[dict, SamplingParams]]:
    tok = llm.get_tokenizer()
    prompts = make_prompts(tok.vocab_size, [3, 9, 17], seed=4)
    return [({"prompt_token_ids": prompts[i % 3]}, p) for i, p in enumerate(_params(tok) * 2)]


def _stepped(llm, requests, defer_steps: int = 0, abort_at: int = -1) -> tuple[dict, list[dict]]:
    """The engine stepped directly: final outputs only (deferring) for the first ``defer_steps`` steps,
    then every step's outputs; all requests aborted at step ``abort_at``. Returns the final outputs
    and, per step after the deferring ones, each request's output."""
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    finals, per_step, step = {}, [], 0
    while engine.has_unfinished_requests():
        engine.final_outputs_only = step < defer_steps
        if step == abort_at:
            outs = engine.abort_request([f"r{i}" for i in range(len(requests))])
        else:
            outs = engine.step()
        if step >= defer_steps:
            per_step.append({o.request_id: _outputs(o) for o in outs})
        finals.update({o.request_id: _outputs(o) for o in outs if o.finished})
        step += 1
    engine.final_outputs_only = False
    assert_pool_empty(llm)
    return finals, per_step


@pytest.fixture(scope="module")
def llms(llama_dir):
    make = lambda: LLM(llama_dir, max_model_len=128, seed=0)  # noqa: E731
    return make(), make()


def test_generate_equals_per_step_detokenization(llms, monkeypatch):
    deferred, eager = llms
    caught_up = []
    real = OutputProcessor._catch_up
    monkeypatch.setattr(OutputProcessor, "_catch_up", lambda self, state: (caught_up.append(state.request_id),
                                                                          real(self, state)))
    requests = _requests(deferred)
    outs = deferred.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert len(caught_up) == len(requests) - 4  # every request but the four with stop strings
    assert len(set(caught_up)) == len(caught_up)  # once each
    ref, _ = _stepped(eager, requests)
    got = {f"r{i}": _outputs(o) for i, o in enumerate(outs)}
    assert got == ref
    texts = [c[1] for cs in got.values() for c in cs]
    assert any(127 < ord(ch) < 0xfffd for t in texts for ch in t)  # multi-byte characters
    assert {c[3] for cs in got.values() for c in cs} == {"length", "stop"}
    assert any(isinstance(c[4], int) for cs in got.values() for c in cs)  # a stop token id
    assert any(c[3] == "stop" and c[4] is None for cs in got.values() for c in cs)  # EOS


@pytest.mark.parametrize("defer_steps", [1, 5, 12])
def test_switching_back_to_per_step_outputs(llms, defer_steps):
    """Final outputs only for the first steps, then every step's outputs: from the switch on, each
    step's outputs equal those of a run that detokenized every step."""
    deferred, eager = llms
    requests = _requests(deferred)
    finals, per_step = _stepped(deferred, requests, defer_steps=defer_steps)
    ref_finals, ref_steps = _stepped(eager, requests)
    assert finals == ref_finals
    assert per_step == ref_steps[defer_steps:]


def test_abort_while_deferred(llms):
    deferred, eager = llms
    requests = _requests(deferred)
    finals, _ = _stepped(deferred, requests, defer_steps=100, abort_at=6)
    ref, _ = _stepped(eager, requests, abort_at=6)
    assert finals == ref
    assert {c[3] for cs in finals.values() for c in cs} >= {"abort"}
