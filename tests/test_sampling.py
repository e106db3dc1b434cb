"""Sampling parameters asserted on concrete outputs: seeds, stop strings, stop token ids,
min/max tokens, n > 1, penalties, top-k/p/min-p, incremental detokenization."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.layers.sampler import Sampler, SamplingRow, apply_penalties


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, kv_cache_memory=4 << 20)


PROMPT = "the king said to the queen"


def greedy_out(llm, n=24, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw),
                        use_tqdm=False)[0].outputs[0]


def test_seeded_sampling_independent_of_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"prompt number {i} about the lord" * (i % 4 + 1) for i in range(16)]
    other_params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=5 + i, ignore_eos=True) for i in range(16)]
    outs = llm.generate(others[:8] + [PROMPT] + others[8:], other_params[:8] + [sp] + other_params[8:], use_tqdm=False)
    assert outs[8].outputs[0].token_ids == alone
    again = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone
    assert_pool_empty(llm)


def test_max_tokens_and_length_finish(llm):
    out = greedy_out(llm, n=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and out.stop_reason is None
    assert_pool_empty(llm)


def test_stop_token_ids_and_min_tokens(llm):
    ref = greedy_out(llm, n=24).token_ids
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = greedy_out(llm, n=24, stop_token_ids=[stop_tok])
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens: the stop token cannot be sampled before 10 tokens exist (its logit is masked),
    # so the output first diverges from greedy where greedy picked it.
    out = greedy_out(llm, n=24, stop_token_ids=[stop_tok], min_tokens=10, logprobs=1)
    assert len(out.token_ids) >= 10 and stop_tok not in out.token_ids[:9]
    assert out.token_ids[:first] == ref[:first] and out.token_ids[first] != stop_tok
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_tok and out.token_ids.count(stop_tok) == 1
    else:
        assert len(out.token_ids) == 24 and stop_tok not in out.token_ids
    # The masked position picked the runner-up: its raw rank is 2.
    assert out.logprobs[first][out.token_ids[first]].rank == 2
    assert_pool_empty(llm)


def test_stop_string_across_token_boundary(llm):
    tok = llm.get_tokenizer()
    ref = greedy_out(llm, n=24)
    pieces = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    # A stop string made of the last char of token 4's text and the first char of token 5's.
    boundary = len(pieces[4])
    stop = ref.text[boundary - 1: boundary + 1]
    assert len(stop) == 2
    idx = ref.text.find(stop)
    out = greedy_out(llm, n=24, stop=[stop, "@@never@@"])
    assert out.text == ref.text[:idx]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(ref.token_ids)
    kept = greedy_out(llm, n=24, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == ref.text[: idx + len(stop)]
    assert_pool_empty(llm)


def test_n_samples(llm):
    outs = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    g = llm.generate([PROMPT], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True),
                     use_tqdm=False)[0].outputs
    assert g[0].token_ids == g[1].token_ids == greedy_out(llm, n=10).token_ids
    assert_pool_empty(llm)


def test_logprobs_top_n(llm):
    out = greedy_out(llm, n=5, logprobs=3)
    for pos, tok in enumerate(out.token_ids):
        entry = out.logprobs[pos]
        assert entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        vals = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert entry[tok].logprob == pytest.approx(vals[0])
    assert_pool_empty(llm)


def test_prompt_logprobs_one_entry_per_prompt_token(llm):
    """prompt_logprobs has one entry per prompt token, the first None, for a one-token prompt too
    (it was [] there: no logits are ever collected for it)."""
    for ids in ([7], [7, 9], [7, 9, 11, 13]):
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        assert all(ids[i] in plp[i] and len(plp[i]) >= 2 for i in range(1, len(ids)))
    assert_pool_empty(llm)


def test_logprobs_above_max_logprobs_refused(llm, llama_dir):
    """More logprobs or prompt_logprobs than max_logprobs (20 by default, as vLLM) is a ValueError
    naming the field and the setting; nothing is queued, and the engine serves the next request."""
    for kw in ({"logprobs": 21}, {"prompt_logprobs": 21}):
        with pytest.raises(ValueError, match=rf"{next(iter(kw))}=21 is more than max_logprobs=20"):
            greedy_out(llm, n=2, **kw)
    assert len(greedy_out(llm, n=3, logprobs=20).logprobs[0]) == 20
    assert_pool_empty(llm)
    small = LLM(llama_dir, kv_cache_memory=4 << 20, max_logprobs=2)
    with pytest.raises(ValueError, match="logprobs=3 is more than max_logprobs=2"):
        greedy_out(small, n=2, logprobs=3)
    assert len(greedy_out(small, n=2, logprobs=2).logprobs[0]) == 2
    assert_pool_empty(small)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0"):
        LLM(llama_dir, kv_cache_memory=4 << 20, max_logprobs=-1)


def test_sampler_filters_reduce_to_greedy():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    expected = logits.argmax(-1).tolist()
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        sp = SamplingParams(temperature=1.0, **kw)
        rows = [SamplingRow(sp, None, [1], []) for _ in range(4)]
        assert Sampler()(logits.clone(), rows).token_ids == expected, kw


def test_plain_greedy_hint_and_token_tensor():
    """The caller's ``all_plain_greedy`` gives the tokens the sampler finds itself; ``token_tensor`` holds
    the ids of ``token_ids`` (greedy, and seeded with a greedy row); a row that is not plain greedy reads
    as such (slotted rows)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    plain = [SamplingRow(SamplingParams(temperature=0.0), None, [1], []) for _ in range(6)]
    for hint in (None, True):
        out = Sampler()(logits, plain, all_plain_greedy=hint)
        assert out.token_ids == logits.argmax(-1).tolist() and out.token_tensor.tolist() == out.token_ids
    rows = [SamplingRow(SamplingParams(temperature=1.0, seed=i), torch.Generator().manual_seed(i), [1], [])
            for i in range(5)] + plain[:1]
    assert [r.plain_greedy for r in rows] == [False] * 5 + [True]
    out = Sampler()(logits, rows)
    again = Sampler()(logits, [SamplingRow(r.params, torch.Generator().manual_seed(r.params.seed or 0), [1], [])
                               if r.generator is not None else r for r in rows], all_plain_greedy=False)
    assert out.token_ids == again.token_ids == out.token_tensor.tolist()
    assert out.token_ids[5] == int(logits[5].argmax())
    with pytest.raises(AttributeError):
        plain[0].extra = 1  # (slots: no per-row attribute dict)


def test_top_k_keeps_only_top_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    top3 = set(logits[0].topk(3).indices.tolist())
    sp = SamplingParams(temperature=5.0, top_k=3)
    gen = torch.Generator().manual_seed(0)
    seen = {Sampler()(logits.clone(), [SamplingRow(sp, gen, [1], [])]).token_ids[0] for _ in range(60)}
    assert seen <= top3 and len(seen) > 1


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    sp = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), [SamplingRow(sp, None, [0], [1])])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    out = apply_penalties(logits.clone(), [SamplingRow(sp, None, [0], [3, 3, 2])])
    assert out.tolist() == [[2.0, -1.0, 0.5 - 1.5, 3.0 - 2.5]]


def test_sampling_params_validation():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"n": 0}, {"max_tokens": 0},
               {"min_p": 2}, {"min_tokens": 5, "max_tokens": 2}):
        with pytest.raises(ValueError, match=list(kw)[0]):
            SamplingParams(**kw)


def test_incremental_detokenizer_never_emits_half_characters(llama_dir):
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    text = "caf\u00e9 \u65e5\u672c\U0001f600 na\u00efve"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    det = IncrementalDetokenizer(tok, [tok.bos_token_id], True, [], False)
    seen = []
    for t in ids:
        det.update([t])
        seen.append(det.output_text)
    assert all("\ufffd" not in s for s in seen)
    assert det.output_text == text
