"""``--stream-interval N`` (vLLM's ``stream_interval``): a running request's output goes to its caller
for its first token, when a sample finishes, and whenever a sample has N tokens more than its last
output carried; the text, token ids, finish reasons and usage are those of ``N = 1``. Checked on the
engine's own outputs (the in-thread path: exact output sizes) and through ``pagedllm serve`` with the
engine core process (streamed chunks joined = the non-streamed answer = the offline engine's)."""
from __future__ import annotations

import json

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from server_utils import RemoteServer, metric

PROMPT = [10, 11, 12, 13]


def output_sizes(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list]:
    """Step the engine as the server's in-thread loop does (every output made, not only the final
    ones): per output of the one request, each sample's token count; and the last output."""
    engine = llm.llm_engine
    rid = engine.add_request(None, {"prompt_token_ids": PROMPT}, params)
    sizes, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            sizes.append([len(c.token_ids) for c in out.outputs])
            last = out
    return sizes, last


@pytest.fixture(scope="module")
def every_token(llama_dir):
    return LLM(llama_dir, kv_cache_memory=1 << 22, max_model_len=256)


@pytest.fixture(scope="module")
def every_4(llama_dir):
    return LLM(llama_dir, kv_cache_memory=1 << 22, max_model_len=256, stream_interval=4)


def test_outputs_every_n_tokens_first_and_last_always(every_token, every_4):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sizes1, last1 = output_sizes(every_token, sp)
    sizes4, last4 = output_sizes(every_4, sp)
    assert sizes1 == [[k] for k in range(1, 11)]
    assert sizes4 == [[1], [5], [9], [10]]  # the first token, then 4 more each time, then the finish
    a, b = last1.outputs[0], last4.outputs[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "length")
    assert last4.finished


def test_n2_each_sample_counts_its_own_tokens(every_token, every_4):
    sp = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=9, ignore_eos=True)
    sizes1, last1 = output_sizes(every_token, sp)
    sizes4, last4 = output_sizes(every_4, sp)
    assert sizes1[-1] == [9, 9] and len(sizes1) == 9
    assert sizes4 == [[1, 1], [5, 5], [9, 9]]
    assert [(c.text, c.token_ids) for c in last4.outputs] == [(c.text, c.token_ids) for c in last1.outputs]


def test_a_sample_that_finishes_is_an_output_at_once(every_4):
    """A stop token id ends a sample between two intervals: its output goes out that step."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sizes, last = output_sizes(every_4, sp)
    stop_id = last.outputs[0].token_ids[5]  # the 6th token: 1 + 4 < 6 < 1 + 8
    first = last.outputs[0].token_ids.index(stop_id)
    sizes, last = output_sizes(every_4, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       stop_token_ids=[stop_id]))
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", stop_id)
    assert sizes == [[k] for k in range(1, first + 1, 4)] + [[first + 1]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_values_are_refused(llama_dir, bad):
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        EngineArgs(model=llama_dir, stream_interval=bad).create_engine_config()


# ---- through the server (engine core process) ------------------------------------------------------
ARGS = ("--kv-cache-memory", "4MiB", "--max-model-len", "256", "--served-model-name", "tiny", "--disable-access-log",
        "--stream-interval", "3")


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("interval") / "server.log"
    with RemoteServer(llama_dir, ARGS, log_path=str(log)) as srv:
        yield srv


def stream_chunks(url: str, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_streamed_text_equals_the_whole_answer(server, every_token):
    itl = "pagedllm:inter_token_latency_seconds_count"
    before = metric(httpx.get(server.url + "/metrics", timeout=10).text, itl, model_name="tiny")
    body = dict(prompt=PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    whole = httpx.post(server.url + "/v1/completions", timeout=120, json={"model": "tiny", **body}).json()
    (ref,) = every_token.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=10,
                                                                                ignore_eos=True), use_tqdm=False)
    chunks = stream_chunks(server.url, **body, stream_options={"include_usage": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"] == ref.outputs[0].text
    # each chunk carries the tokens of one output (or of several, merged when the reader lags):
    # cumulative counts on the outputs' grid 1, 4, 7, 10
    counts, total = [], 0
    for c in choices:
        total += len(c["logprobs"]["tokens"])
        counts.append(total)
    assert counts[-1] == 10 and set(counts) <= {1, 4, 7, 10}, counts
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10 == whole["usage"]["completion_tokens"]
    # inter-token latency is still observed once a token after the first (9 a request), as with N = 1
    after = metric(httpx.get(server.url + "/metrics", timeout=10).text, itl, model_name="tiny")
    assert after - before == 2 * 9


def test_streamed_n2_and_a_stop_string(server, every_token):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,) = every_token.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip() and len(stop) == 2
    body = dict(prompt=PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop], n=2)
    whole = httpx.post(server.url + "/v1/completions", timeout=120, json={"model": "tiny", **body}).json()
    chunks = stream_chunks(server.url, **body, stream_options={"include_usage": True})
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"] == text[:text.index(stop)]
        assert mine[-1]["finish_reason"] == "stop" and mine[-1]["stop_reason"] == stop
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
