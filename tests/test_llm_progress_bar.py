"""generate's progress bar: redrawn at most every ``BAR_REFRESH_S`` seconds, its final count the
number of prompts, and the outputs the same with the bar on or off."""
from __future__ import annotations

import pytest

import pagedllm.llm as llm_module
from pagedllm import LLM, SamplingParams


class RecordingBar(llm_module.tqdm):
    """The bar ``LLM._run_engine`` makes, recording each instance and its ``update`` calls."""
    made: list["RecordingBar"] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.updates: list[int] = []
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)
        return super().update(n)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=128, seed=0)


def _run(llm, monkeypatch, use_tqdm: bool, refresh_s: float):
    monkeypatch.setattr(llm_module, "tqdm", RecordingBar)
    monkeypatch.setattr(llm_module, "BAR_REFRESH_S", refresh_s)
    RecordingBar.made.clear()
    prompts = [[5 + i, 9, 11 + 2 * i] for i in range(12)]
    # different lengths: the requests finish in different steps
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 5, ignore_eos=True) for i in range(12)]
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    (bar,) = RecordingBar.made
    return outs, bar


def test_bar_final_count_and_outputs_with_and_without_bar(llm, monkeypatch, capsys):
    off, bar_off = _run(llm, monkeypatch, False, 0.25)
    on, bar_on = _run(llm, monkeypatch, True, 0.25)
    assert [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in on] == \
        [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in off]
    assert [len(o.outputs[0].token_ids) for o in on] == [1 + i % 5 for i in range(12)]
    assert bar_on.n == 12 and sum(bar_on.updates) == 12
    assert bar_on.postfix.startswith("output ") and bar_on.postfix.endswith(" tok/s")
    assert bar_off.disable and bar_off.updates == []  # the disabled bar is never touched
    assert "Processed prompts" in capsys.readouterr().err


def test_bar_redraws_are_bounded_by_the_interval(llm, monkeypatch):
    # An interval longer than the run: one draw, at the end, with the final count.
    _, bar = _run(llm, monkeypatch, True, 3600.0)
    assert bar.updates == [12] and bar.n == 12
    # No interval: a draw after every step in which a request finished (5 distinct lengths).
    _, bar = _run(llm, monkeypatch, True, 0.0)
    assert len(bar.updates) == 5 and sum(bar.updates) == 12 and bar.n == 12
