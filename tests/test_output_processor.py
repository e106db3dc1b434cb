"""OutputProcessor.make_output: every field of the RequestOutput and its CompletionOutputs, read by name,
from hand-made sequences (no model): one sample and n = 2 (logprobs, one still running, then both
finished), and the request's times (earliest first scheduling and token, latest last token and
finish; unset times left out)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def _request(tok, rid: str, params: SamplingParams, index: int = 0, parent: str = "p") -> Request:
    req = Request(rid, [5, 6, 7], params, tok.eos_token_id, arrival_time=100.0 + index, parent_id=parent,
                  index=index)
    for t in tok.encode(" the end", add_special_tokens=False):
        req.append_output_token(t)
    return req


def test_one_sample(tok):
    op = OutputProcessor(tok)
    req = _request(tok, "p", SamplingParams(max_tokens=4))
    req.num_cached_tokens = 2
    m = req.metrics
    m.first_scheduled_time, m.first_token_time, m.last_token_time = 0.0, 101.5, 102.0  # 0: unset
    op.add_request("p", "a prompt", [5, 6, 7], [req])
    op.process([req])
    out = op.make_output("p")
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.finished,
            out.num_cached_tokens, out.pooled) == ("p", "a prompt", [5, 6, 7], None, False, 2, None)
    (c,) = out.outputs
    assert (c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason) == (
        0, " the end", req.output_token_ids, None, None, None, None)
    assert c.token_ids is not req.output_token_ids
    assert (out.metrics.arrival_time, out.metrics.first_scheduled_time, out.metrics.first_token_time,
            out.metrics.last_token_time, out.metrics.finished_time) == (100.0, None, 101.5, 102.0, None)
    req.status, req.stop_reason, m.finished_time = RequestStatus.FINISHED_STOPPED, "!", 103.0
    out = op.make_output("p")
    assert (out.finished, out.outputs[0].finish_reason, out.outputs[0].stop_reason,
            out.metrics.finished_time) == (True, "stop", "!", 103.0)
    assert "p" not in op.states  # a finished request's state is dropped


def test_two_samples_with_logprobs(tok):
    op = OutputProcessor(tok)
    params = SamplingParams(n=2, max_tokens=4, logprobs=1, prompt_logprobs=0)
    reqs = [_request(tok, "q", params, 0, "q"), _request(tok, "q#1", params, 1, "q")]
    for i, r in enumerate(reqs):
        r.cumulative_logprob = -1.5 - i
        r.logprobs = [{7: Logprob(-0.5, 1, "x")}] * len(r.output_token_ids)
        r.metrics.first_scheduled_time = 100.5 + i
        r.metrics.first_token_time = None if i == 0 else 101.0
        r.metrics.last_token_time = 102.0 + i
    reqs[0].prompt_logprobs.extend([{6: Logprob(-2.0, 3, "y")}] * 2)
    reqs[0].status, reqs[0].metrics.finished_time = RequestStatus.FINISHED_LENGTH_CAPPED, 104.0
    op.add_request("q", None, [5, 6, 7], reqs)
    op.process(reqs)
    out = op.make_output("q")
    assert not out.finished and out.prompt_logprobs == reqs[0].prompt_logprobs
    assert [(c.index, c.text, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in out.outputs] == [
        (0, " the end", -1.5, reqs[0].logprobs, "length"), (1, " the end", -2.5, reqs[1].logprobs, None)]
    assert out.outputs[0].logprobs is not reqs[0].logprobs
    assert (out.metrics.arrival_time, out.metrics.first_scheduled_time, out.metrics.first_token_time,
            out.metrics.last_token_time, out.metrics.finished_time) == (100.0, 100.5, 101.0, 103.0, None)
    reqs[1].status, reqs[1].metrics.finished_time = RequestStatus.FINISHED_STOPPED, 103.5
    out = op.make_output("q")
    assert out.finished and out.metrics.finished_time == 104.0
    assert [c.finish_reason for c in out.outputs] == ["length", "stop"]
