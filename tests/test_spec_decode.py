"""Speculative decoding (--speculative-config, engine/speculator.py, spec_decode/): greedy output equal to
decoding without proposals for ngram and draft_model (through chunked prefill, preemption, n > 1, logprobs,
min_tokens), the rejection sampler's output following the target distribution (chi-square), the block
pools empty after every run, the settings parsed and refused as vLLM takes them."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from conftest import assert_pool_empty, build_checkpoint, pagedllm_logs
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.spec_decode.config import parse_speculative_config
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.rejection_sampler import rejection_sample

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16 channels, float32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def chi2_sf(x: float, df: int) -> float:
    """P(chi2(df) > x), Wilson-Hilferty's normal approximation (good to ~1e-3 at df >= 3)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def two_sample_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that counts ``a`` and ``b`` come from one distribution."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        tot = a[k] + b[k]
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (a[k] - ea) ** 2 / ea + (b[k] - eb) ** 2 / eb
    return chi2_sf(stat, max(1, len(keys) - 1))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """A one-layer random model with the llama fixture's tokenizer (another seed: its proposals are wrong)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("draft")), "llama", seed=7, num_hidden_layers=1)


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(10, 500) for _ in range(rng.randint(4, 60))]
        out.append({"prompt_token_ids": p + p[:8]})  # a repeat, for the n-gram proposer
    return out


def engine(model: str, spec=None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 2 ** 22)
    kw.setdefault("max_num_seqs", 8)
    return LLM(model, speculative_config=spec, **kw)


def token_ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def draft_pool_empty(llm: LLM) -> None:
    draft = llm.llm_engine.draft
    if draft is not None:
        assert draft.kv.req_to_blocks == {} and not draft.fed
        assert draft.kv.block_pool.get_num_free_blocks() == draft.kv.block_pool.num_usable_blocks


# ---- settings ----------------------------------------------------------------------------------------------
def test_config_parsing_and_refusals(llama_dir):
    s = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert parse_speculative_config({"model": "/x", "num_speculative_tokens": 2}).method == "draft_model"
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None
    for bad, msg in [({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported"),
                     ({"method": "medusa", "num_speculative_tokens": 1}, "'medusa' is not supported"),
                     ({"method": "ngram"}, "num_speculative_tokens is required"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "x"},
                      "'speculative_token_tree' not supported"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                       "prompt_lookup_max": 2}, "prompt_lookup_min=4 is more than"),
                     ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model")]:
        with pytest.raises(ValueError, match=msg):
            parse_speculative_config(bad)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineArgs(model=llama_dir, pipeline_parallel_size=2, speculative_config=NGRAM).create_engine_config()
    with pytest.raises(ValueError, match="pooling"):
        EngineArgs(model=llama_dir, runner="pooling", speculative_config=NGRAM).create_engine_config()


def test_draft_with_another_vocabulary_is_refused(llama_dir, tmp_path):
    other = build_checkpoint(str(tmp_path / "small"), "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        EngineArgs(model=llama_dir, speculative_config={"model": other, "num_speculative_tokens": 2}
                   ).create_engine_config()


def test_cli_flag_json_and_dotted_forms_merge(llama_dir):
    import argparse
    import shlex

    from pagedllm.engine import vllm_compat
    from pagedllm.entrypoints import cli

    line = (f"serve {llama_dir} --speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": 2}}' "
            f"--speculative-config.prompt_lookup_max=3 --speculative-config.num_speculative_tokens 5")
    args = cli.build_parser().parse_args(vllm_compat.normalize_argv(shlex.split(line)))
    assert isinstance(args, argparse.Namespace)
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.speculative_config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    spec = engine_args.create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 5, 3, 3)


# ---- proposers and the rejection sampler ---------------------------------------------------------------------
def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(1, 3)
    #           0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    assert p.propose(toks, 3) == [1, 2, 6]  # "6 7" last seen at 6..7 (the 3-gram "2 6 7" is new)
    assert p.propose([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # the latest occurrence of "3 1 2"... of "1 2"
    assert p.propose([1, 2, 3, 4], 2) == []  # nothing repeats
    assert NgramProposer(2, 2).propose([4, 9, 4], 2) == []  # a 1-gram match does not count at n >= 2
    assert p.propose([256, 1, 256], 2) == [1, 256]  # 256 = 0x100: a misaligned byte match is skipped


@pytest.mark.parametrize("point_mass", [True, False])
def test_rejection_sampler_follows_the_target_distribution(point_mass):
    """First and second emitted tokens over 20,000 trials against p_1 and p_2 (given d_1 accepted):
    chi-square, p > 1e-3. A skewed draft q (or point masses at unlikely tokens) changes nothing."""
    torch.manual_seed(0)
    V, k, n = 6, 2, 20000
    p = torch.softmax(torch.randn(k + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V) * 2.0, -1)
    firsts, seconds = Counter(), Counter()
    drafts_all = []
    for _ in range(n):
        if point_mass:
            drafts = [int(p[0].argsort()[-2]), int(p[1].argmin())]  # the second likeliest, the least likely
        else:
            drafts = [int(torch.multinomial(q[j], 1)) for j in range(k)]
        drafts_all.append(drafts)
    probs = p.repeat(n, 1)
    res = rejection_sample(probs, probs.argmax(-1), [False] * n, drafts_all,
                           None if point_mass else [q] * n, [None] * n)
    for r, d in zip(res, drafts_all):
        assert r.token_ids[:r.num_accepted] == d[:r.num_accepted] and len(r.token_ids) == r.num_accepted + 1
        firsts[r.token_ids[0]] += 1
        if r.num_accepted >= 1:  # (p_2 does not depend on the first token here)
            seconds[r.token_ids[1]] += 1

    def p_value(counts: Counter, dist: torch.Tensor) -> float:
        tot = sum(counts.values())
        stat = sum((counts[t] - tot * float(dist[t])) ** 2 / (tot * float(dist[t])) for t in range(V))
        return chi2_sf(stat, V - 1)

    assert p_value(firsts, p[0]) > 1e-3
    assert sum(seconds.values()) > 500 and p_value(seconds, p[1]) > 1e-3


def test_rejection_sampler_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    res = rejection_sample(None, logits.argmax(-1), [True], [[1, 2]], None, [None])
    assert res[0].token_ids == [1, 0] and res[0].num_accepted == 1
    res = rejection_sample(None, logits.argmax(-1), [True], [[1, 0]], None, [None])
    assert res[0].token_ids == [1, 0, 2] and res[0].num_accepted == 2


# ---- the engine ------------------------------------------------------------------------------------------------
def test_ngram_greedy_equals_plain_decoding(llama_dir):
    """Through chunked prefill (16-token steps), n = 2, min_tokens, logprobs, logit_bias."""
    ps = prompts(6)
    # a logit bias on three tokens makes the output cycle through them: proposals are often right
    sp = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logit_bias={20: 50.0, 21: 50.0, 22: 50.0}),
          SamplingParams(temperature=0, max_tokens=40, n=2, min_tokens=10, logprobs=2)]
    sps = [sp[i % 2] for i in range(len(ps))]
    base = engine(llama_dir, max_num_batched_tokens=16)
    want = base.generate(ps, sps)
    llm = engine(llama_dir, NGRAM, max_num_batched_tokens=16)
    got = llm.generate(ps, sps)
    assert token_ids(got) == token_ids(want)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs is not None:
                assert len(gc.logprobs) == len(wc.logprobs)
                for a, b in zip(gc.logprobs, wc.logprobs):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    st = llm.llm_engine.speculator.stats
    assert st.num_drafts > 20 and 0.2 * st.num_draft_tokens < st.num_accepted_tokens <= st.num_draft_tokens
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert_pool_empty(llm)


def test_ngram_under_preemption_equals_plain_decoding(llama_dir):
    """A pool of 12 blocks for 8 sequences: requests are preempted and recomputed, proposals and all."""
    ps = prompts(8, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logit_bias={20: 50.0, 21: 50.0, 22: 50.0})
    base = engine(llama_dir, kv_cache_memory=12 * BLOCK_BYTES, max_model_len=128)
    want = base.generate(ps, sp)
    llm = engine(llama_dir, NGRAM, kv_cache_memory=12 * BLOCK_BYTES, max_model_len=128)
    got = llm.generate(ps, sp)
    assert token_ids(got) == token_ids(want)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0
    assert_pool_empty(llm)


def test_draft_model_equal_to_target_accepts_everything(llama_dir):
    ps = prompts(5, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = engine(llama_dir).generate(ps, sp)
    llm = engine(llama_dir, {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3})
    assert token_ids(llm.generate(ps, sp)) == token_ids(want)
    st = llm.llm_engine.speculator.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.mean_acceptance_length > 3.0
    assert_pool_empty(llm)
    draft_pool_empty(llm)


def test_random_draft_model_accepts_almost_nothing_and_changes_nothing(llama_dir, draft_dir):
    ps = prompts(5, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = engine(llama_dir).generate(ps, sp)
    llm = engine(llama_dir, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3})
    assert token_ids(llm.generate(ps, sp)) == token_ids(want)
    st = llm.llm_engine.speculator.stats
    assert st.num_draft_tokens > 100 and st.num_accepted_tokens < 0.1 * st.num_draft_tokens
    assert_pool_empty(llm)
    draft_pool_empty(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_follow_the_target_distribution(llama_dir, draft_dir, method):
    """600 seeded samples with and without speculation, over 5 allowed tokens, with a repetition penalty,
    a logit bias and top-k: output tokens 1-3 (verified by rejection sampling) have the same distribution
    per position (two-sample chi-square, p > 1e-3). The draft model is the random one: some proposals are
rejected, so the residual distribution is drawn from too."""
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = assert_sampled_distribution_unchanged(llama_dir, spec)
    draft_pool_empty(llm)


def assert_sampled_distribution_unchanged(model: str, spec: dict, min_accepted: int = 100, **kw) -> LLM:
    """The chi-square check above for any model and method (``tests/test_spec_mtp.py`` runs it for mtp):
    returns the speculating engine (its pool checked empty)."""
    allowed = [11, 12, 13, 14, 15]
    n = 600
    ps = [{"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]}] * n
    sps = [SamplingParams(temperature=1.5, max_tokens=4, seed=1000 + i, allowed_token_ids=allowed,
                          repetition_penalty=1.2, logit_bias={12: 0.7}, top_k=4, ignore_eos=True) for i in range(n)]
    kw = {"max_num_seqs": 128, "kv_cache_memory": 2 ** 24, **kw}
    want = engine(model, **kw).generate(ps, sps)
    llm = engine(model, spec, **kw)
    got = llm.generate(ps, sps)
    st = llm.llm_engine.speculator.stats
    assert st.num_accepted_tokens > min_accepted and st.num_accepted_tokens < st.num_draft_tokens
    for pos in (1, 2, 3):
        a = Counter(o.outputs[0].token_ids[pos] for o in want)
        b = Counter(o.outputs[0].token_ids[pos] for o in got)
        assert set(b) <= set(allowed)
        assert two_sample_p(a, b) > 1e-3, (pos, a, b)
    # seeded requests are reproducible with speculation too
    again = engine(model, spec, **kw).generate(ps[:50], sps[:50])
    assert token_ids(again) == token_ids(got[:50])
    assert_pool_empty(llm)
    return llm


def test_unservable_requests_decode_without_proposals(llama_dir):
    """Stop strings: no proposals for them (said once in the log); the output is as without speculation."""
    ps = prompts(3, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=20, stop=["zzzz"], ignore_eos=True)
    want = engine(llama_dir).generate(ps, sp)
    llm = engine(llama_dir, NGRAM)
    with pagedllm_logs() as logs:
        got = llm.generate(ps, sp)
    assert token_ids(got) == token_ids(want)
    lines = [r.getMessage() for r in logs if "no proposals for requests with stop strings" in r.getMessage()]
    assert len(lines) == 1
    assert llm.llm_engine.speculator.stats.num_drafts == 0
    assert_pool_empty(llm)


def test_disable_by_batch_size_turns_proposals_off(llama_dir):
    ps = prompts(6, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = engine(llama_dir, {**NGRAM, "disable_by_batch_size": 2})
    got = llm.generate(ps, sp)
    assert token_ids(got) == token_ids(engine(llama_dir).generate(ps, sp))
    on = llm.llm_engine.speculator.stats.num_drafts
    llm.generate(ps[:1], sp)  # one sequence: proposals on
    assert llm.llm_engine.speculator.stats.num_drafts > on
    assert_pool_empty(llm)


def test_server_with_speculative_config_serves_and_counts(llama_dir):
    """`pagedllm serve --speculative-config.method=ngram ...` (vLLM's dotted form): a completion equal to the
    offline one without speculation, the start-up line, and vllm:spec_decode_* on /metrics."""
    import httpx

    from server_utils import RemoteServer, metric

    prompt = prompts(1, seed=5)[0]["prompt_token_ids"]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={20: 50.0, 21: 50.0, 22: 50.0})
    want = engine(llama_dir).generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].text
    with RemoteServer(llama_dir, ("--speculative-config.method=ngram", "--speculative-config.num_speculative_tokens",
                                  "3", "--speculative-config.prompt_lookup_min=1", "--kv-cache-memory", "4MiB",
                                  "--max-num-seqs", "4")) as srv:
        body = {"model": llama_dir, "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "logit_bias": {"20": 50, "21": 50, "22": 50}}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        log = srv.log()
    assert choice["text"] == want
    assert "speculative decoding: ngram" in log and "k=3" in log
    drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert metric(text, "pagedllm:spec_decode_num_accepted_tokens_total") == accepted
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


def test_bench_speculative_runs_and_outputs_match(llama_dir, tmp_path):
    import argparse
    import json

    from pagedllm.benchmarks import speculative

    p = argparse.ArgumentParser()
    speculative.add_args(p)
    args = p.parse_args(["--model", llama_dir, "--batch-sizes", "1,3", "--output-len", "12", "--repeats", "1",
                         "--num-speculative-tokens", "3", "--prompt-lookup-min", "1", "--kv-cache-memory",
                         str(2 ** 23), "--passage-chars", "200", "--max-model-len", "512", "--output-dir", str(tmp_path)])
    result = args.func(args)
    assert [r["batch_size"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["outputs_identical"]
        assert row["on"]["num_drafts"] > 0 and row["off"]["output_tokens"] == row["on"]["output_tokens"]
        assert 1.0 <= row["on"]["mean_acceptance_length"] <= 4.0
    saved = json.load(open(next(tmp_path.glob("speculative_ngram*.json"))))
    assert saved["speculative_config"]["method"] == "ngram"
