"""LoRA adapters (pagedllm/lora/): PEFT's format, the batched op, mixed batches against transformers + PEFT.

Three adapters with different ranks and targets are built with PEFT on tiny random Llama, Qwen2 and
Gemma 2 bases (random A and B, so every adapter changes the output); one batch mixes requests of each
adapter with base-model requests; fp32 greedy ids must equal transformers + PEFT's token for token.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from conftest import assert_pool_empty, build_checkpoint
from test_correctness import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.lora.ops import lora_add_, lora_add_reference, make_step
from pagedllm.lora.peft import LoRAFormatError, load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LoRASlotTable

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
# (name, rank, alpha, rsLoRA, targets)
ADAPTERS = [
    ("sql", 4, 8, False, ["q_proj", "v_proj"]),
    ("chat", 8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("law", 16, 24, False, ["k_proj", "o_proj", "gate_proj", "down_proj"]),
]
BASES = {"llama": {}, "qwen2": {}, "gemma2": {"num_hidden_layers": 3}}


def make_adapter(base_dir: str, out_dir: str, rank: int, alpha: int, rslora: bool, targets: list[str],
                 seed: int, **extra) -> str:
    """A PEFT LoRA adapter of ``base_dir`` with random A and B (PEFT's B starts at zero: no effect)."""
    import transformers  # noqa: F401  (peft needs it)

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0,
                          init_lora_weights=False, **extra)
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.25)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], logprobs: bool = False) -> list:
    """transformers (+ PEFT with ``adapter_dir``) fp32 greedy ids of each prompt ((ids, logprobs) with ``logprobs``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return [hf_greedy(model, p, MAX_TOKENS) if logprobs else hf_greedy(model, p, MAX_TOKENS)[0] for p in prompts]


def mixed(adapters: dict) -> tuple[list, list]:
    """(the three LoRARequests, the lora_request of 8 prompts: each adapter twice, base twice)."""
    reqs = [LoRARequest(name, i + 1, adapters[name]) for i, (name, *_rest) in enumerate(ADAPTERS)]
    return reqs, [None, reqs[0], reqs[1], reqs[2], None, reqs[2], reqs[1], reqs[0]]


def vocab_of(d: str) -> int:
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)["vocab_size"]


_EXPECTED: dict = {}


def expected(d: str, order: list, ps: list) -> list[list[int]]:
    """transformers + PEFT greedy ids of each (adapter, prompt), cached."""
    out = []
    for lr, p in zip(order, ps):
        key = (d, lr and lr.lora_path, tuple(p))
        if key not in _EXPECTED:
            _EXPECTED[key] = peft_greedy(d, None if lr is None else lr.lora_path, [p])[0]
        out.append(_EXPECTED[key])
    return out


_BUILT: dict = {}


@pytest.fixture(scope="module", params=list(BASES))
def base(request, tmp_path_factory):
    """(arch, base dir, {adapter name: dir})"""
    arch = request.param
    if arch not in _BUILT:
        root = tmp_path_factory.mktemp(f"lora-{arch}")
        d = build_checkpoint(str(root / "base"), arch, seed=3, **BASES[arch])
        adapters = {name: make_adapter(d, str(root / name), r, a, rs, t, seed=i + 10)
                    for i, (name, r, a, rs, t) in enumerate(ADAPTERS)}
        _BUILT[arch] = (arch, d, adapters)
    return _BUILT[arch]


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def test_mixed_batch_equals_transformers_peft(base):
    arch, d, adapters = base
    reqs, order = mixed(adapters)
    ps = prompts(vocab_of(d), 8)
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory=4 << 20,
              max_num_batched_tokens=64)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(ps, sp, use_tqdm=False, lora_request=order)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected(d, order, ps), arch
    # every adapter changes the output (else the test could not fail)
    base_out = expected(d, [None] * 8, ps)
    assert all(got[i] != base_out[i] for i, lr in enumerate(order) if lr is not None)
    assert_pool_empty(llm)
    # prefix caching: the same prompt under another adapter hits no block of the first
    again = llm.generate([ps[3]] * 2, sp, use_tqdm=False, lora_request=[reqs[0], reqs[2]])
    assert again[1].outputs[0].token_ids == got[3]
    assert again[0].outputs[0].token_ids == peft_greedy(d, reqs[0].lora_path, [ps[3]])[0]
    assert_pool_empty(llm)


@pytest.mark.parametrize("slices", [[(0, 40)], [(0, 16), (16, 8), (24, 16)]])
def test_ops_equal_reference(slices):
    torch.manual_seed(0)
    n, din, dout, slots, rmax = 37, 24, 40, 4, 6
    x = torch.randn(n, din)
    ranks = [6, 2, 0, 4]
    a = torch.zeros(slots, len(slices) * rmax, din)
    b = torch.zeros(slots, rmax, dout)  # B transposed
    for s, r in enumerate(ranks):
        for i in range(len(slices)):
            a[s, i * rmax:i * rmax + r] = torch.randn(r, din)
        b[s, :r] = torch.randn(r, dout)
    token_slots = torch.tensor([random.Random(i).choice([-1, 0, 1, 2, 3]) for i in range(n)])
    y0 = torch.randn(n, dout)
    ref = y0.clone()
    lora_add_reference(ref, x, a, b, ranks, slices, token_slots)
    assert not torch.equal(ref, y0)
    for mode in ("grouped", "bmm"):
        y = y0.clone()
        lora_add_(y, x, a, b, ranks, slices, make_step(token_slots, mode))
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert make_step(torch.full((5,), -1), "bmm") is None


def test_slot_table_lru():
    class R:
        def __init__(self, lr):
            self.lora_request = lr
    t = LoRASlotTable(2)
    a, b, c = (LoRARequest(n, i + 1, "/x") for i, n in enumerate("abc"))
    assert t.batch([(R(None), 3)]) is None
    batch = t.batch([(R(a), 2), (R(None), 1), (R(b), 1)])
    assert batch.token_slots.tolist() == [0, 0, -1, 1]
    assert batch.slot_adapters == {0: a, 1: b}
    t.batch([(R(b), 1)])  # b used last: a is the least recently used
    batch = t.batch([(R(c), 1), (R(b), 1)])
    assert batch.slot_adapters[0] == c and batch.slot_adapters[1] == b


def test_bad_adapters_are_refused(base, tmp_path):
    arch, d, adapters = base
    if arch != "llama":
        pytest.skip("format checks need one base")
    import transformers
    hf = transformers.AutoConfig.from_pretrained(d)
    with pytest.raises(LoRAFormatError, match="rank 16 is greater than max_lora_rank 8"):
        load_peft_adapter(adapters["law"], 8, hf)
    with pytest.raises(LoRAFormatError, match="no adapter_config.json"):
        load_peft_adapter(str(tmp_path), 16, hf)
    saved = make_adapter(d, str(tmp_path / "mts"), 4, 8, False, ["q_proj"], 1, modules_to_save=["lm_head"])
    with pytest.raises(LoRAFormatError, match="modules_to_save"):
        load_peft_adapter(saved, 16, hf)
    head = make_adapter(d, str(tmp_path / "head"), 4, 8, False, ["q_proj", "lm_head"], 1)
    with pytest.raises(LoRAFormatError, match="lm_head"):
        load_peft_adapter(head, 16, hf)
    llm = LLM(d, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="greater than max_lora_rank"):
        llm.generate([[7, 8, 9]], lora_request=LoRARequest("law", 3, adapters["law"]), use_tqdm=False)
    assert_pool_empty(llm)
    nolora = LLM(d, dtype="float32", kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        nolora.generate([[7, 8, 9]], lora_request=LoRARequest("sql", 1, adapters["sql"]), use_tqdm=False)


def test_one_slot_lru_and_preemption_equal_transformers_peft(base):
    """--max-loras 1: a step holds one adapter (the scheduler waits), the slot is reloaded from the CPU
    cache (--max-cpu-loras 2 < 3 adapters: from disk too); a small KV cache preempts requests."""
    arch, d, adapters = base
    if arch != "llama":
        pytest.skip("one base is enough")
    reqs, order = mixed(adapters)
    ps = prompts(vocab_of(d), 8)
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_memory=48 << 10, max_model_len=64,
              max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(ps, sp, use_tqdm=False, lora_request=order)
    assert [o.outputs[0].token_ids for o in outs] == expected(d, order, ps)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert len(llm.llm_engine.executor.runner.lora.cache) == 2
    assert_pool_empty(llm)


def test_tensor_parallel_2_equals_transformers_peft(base):
    arch, d, adapters = base
    if arch != "llama":
        pytest.skip("one base is enough")
    reqs, order = mixed(adapters)
    ps = prompts(vocab_of(d), 8)
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=3, tensor_parallel_size=2, kv_cache_memory=4 << 20)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(ps, sp, use_tqdm=False, lora_request=order)
        assert [o.outputs[0].token_ids for o in outs] == expected(d, order, ps)
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("kw, tol", [(dict(quantization="int8", dtype="float32"), 0.12),
                                     (dict(dtype="bfloat16"), 0.12)])
def test_int8_and_bf16_bases_follow_peft(base, kw, tol):
    """int8 (W8A8) and bf16 bases round, so greedy paths may part from fp32's: teacher-forced on
    transformers + PEFT's greedy ids, the logprobs of those ids stay within ``tol`` (mean absolute),
    while the adapters move them by far more than that (measured: errors 0.01-0.07, adapters move 2.5-4)."""
    arch, d, adapters = base
    if arch != "llama":
        pytest.skip("one base is enough")
    reqs, order = mixed(adapters)
    ps = prompts(vocab_of(d), 8)
    llm = LLM(d, enable_lora=True, max_loras=3, kv_cache_memory=4 << 20, **kw)
    ref = [peft_greedy(d, None if lr is None else lr.lora_path, [p], logprobs=True)[0] for lr, p in zip(order, ps)]
    full = [p + toks for p, (toks, _) in zip(ps, ref)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(full, sp, use_tqdm=False, lora_request=order)
    base_outs = llm.generate(full, sp, use_tqdm=False)
    for i, (o, bo, (toks, lps)) in enumerate(zip(outs, base_outs, ref)):
        n = len(ps[i])
        got = [o.prompt_logprobs[n + j][t].logprob for j, t in enumerate(toks)]
        err = sum(abs(a - b) for a, b in zip(got, lps)) / len(lps)
        assert err < tol, (i, kw, err)
        if order[i] is not None:
            moved = [bo.prompt_logprobs[n + j][t].logprob for j, t in enumerate(toks)]
            assert sum(abs(a - b) for a, b in zip(moved, lps)) / len(lps) > 5 * tol
    assert_pool_empty(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters_equals_transformers_peft(base, method):
    """--speculative-config with --enable-lora: a LoRA request's proposals are verified by the target under
    its adapter (the verification batch carries each token's slot), so greedy output is PEFT's; the draft
    model (the base itself) proposes without adapters: base requests accept every proposal."""
    arch, d, adapters = base
    if arch != "llama":
        pytest.skip("one base is enough")
    reqs, order = mixed(adapters)
    rng = random.Random(7)
    vocab = vocab_of(d)
    # periodic prompts: n-gram lookup has something to propose from the first decode step on
    ps = [[rng.randrange(6, vocab) for _ in range(rng.randrange(3, 6))] * 4 for _ in range(8)]
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if method == "ngram" else {"method": "draft_model", "model": d, "num_speculative_tokens": 3})
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory=4 << 20,
              max_num_batched_tokens=64, speculative_config=spec)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(ps, sp, use_tqdm=False, lora_request=order)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected(d, order, ps)
    stats = llm.llm_engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens > 0
    assert_pool_empty(llm)
