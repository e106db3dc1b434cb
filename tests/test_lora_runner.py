"""LoRA adapters inside the CPU layer runner (platforms/cpu/lora_ops.cpp, called by layer_runner.cpp after
each target linear): the kernel against the per-token definition; mixed batches (base + three adapters of
different ranks and targets) with the runner on against the runner off (the Python loop's forward hooks):
logprobs within float32 summation noise, fp32 greedy ids equal to transformers + PEFT; the runner's count
of steps with adapter tokens proves it took them. Bases wide enough that every linear packs for
float_gemm_cpu (the runner's condition; test_lora.py's tiny bases leave it off).
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_pool_empty, build_checkpoint
from test_cpu_layer_runner import WIDE, _runner_or_skip
from test_lora import ADAPTERS, expected, make_adapter, mixed, prompts, vocab_of

from pagedllm import LLM, SamplingParams
from pagedllm.lora.ops import lora_add_reference, make_step
from pagedllm.platforms.cpu import lora_ops as cpu_lora_ops
from pagedllm.platforms.cpu import float_gemm as float_gemm_cpu

pytest.importorskip("peft")

MAX_TOKENS = 8


def _kernel_or_skip() -> None:
    lib, err = cpu_lora_ops._LIBRARY.get()
    if lib is None:
        pytest.skip(f"the CPU LoRA kernel cannot be built here: {err}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices", [[(0, 40)], [(0, 16), (16, 8), (24, 17)], [(0, 33), (33, 20)]])
def test_kernel_equals_reference(slices, dtype):
    """Ranks 6, 2, 0 (slot untouched) and 5 of at most 6; slices and widths off the 16-lane vectors;
    groups longer than a 4-token unit; base tokens (-1) untouched."""
    _kernel_or_skip()
    torch.manual_seed(0)
    n, din, dout, slots, rmax = 37, 27, sum(s for _, s in slices), 4, 6
    x = torch.randn(n, din)
    ranks = [6, 2, 0, 5]
    a = torch.zeros(slots, len(slices) * rmax, din)
    b = torch.zeros(slots, rmax, dout)
    for s, r in enumerate(ranks):
        for i in range(len(slices)):
            a[s, i * rmax:i * rmax + r] = torch.randn(r, din)
        b[s, :r] = torch.randn(r, dout)
    token_slots = torch.tensor([random.Random(i).choice([-1, 0, 1, 2, 3]) for i in range(n)])
    x, a, b = x.to(dtype).float(), a.to(dtype).float(), b.to(dtype).float()  # the values the kernel sees
    y0 = torch.randn(n, dout).to(dtype)
    ref = y0.float().clone()
    lora_add_reference(ref, x, a, b, ranks, slices, token_slots)
    step = make_step(token_slots)
    y = y0.clone()
    cpu_lora_ops.lora_add(y, x.to(dtype), a.to(dtype), b.to(dtype), torch.tensor(ranks, dtype=torch.int32),
                          [0] + [o + s for o, s in slices], step.order, step.bounds, step.slots)
    base = token_slots < 0
    assert torch.equal(y[base], y0[base])
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:  # float32 sums, y rounded once to bf16: within half a bf16 ulp of the exact value
        assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
    assert not torch.equal(ref, y0.float())


_BUILT: dict = {}


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2"])
def wide_base(request, tmp_path_factory):
    """(arch, a wide base, {adapter name: dir}): test_lora's three adapters on a base the runner covers."""
    arch = request.param
    if arch not in _BUILT:
        root = tmp_path_factory.mktemp(f"lora-wide-{arch}")
        extra = dict(head_dim=64) if arch == "gemma2" else {}
        d = build_checkpoint(str(root / "base"), arch, seed=3, **WIDE, **extra)
        adapters = {name: make_adapter(d, str(root / name), r, a, rs, t, seed=i + 10)
                    for i, (name, r, a, rs, t) in enumerate(ADAPTERS)}
        _BUILT[arch] = (arch, d, adapters)
    return _BUILT[arch]


def _generate(llm, ps, order, on: bool, **sp):
    """Outputs of ``ps`` (one lora_request each) with the runner on or off; asserts which path ran the
    steps with adapter tokens."""
    model = llm.llm_engine.executor.runner.model
    model.use_cpu_layer_runner = on
    runner = model.__dict__.get("_cpu_layer_runner")
    before = runner.lora_steps_run if runner else 0
    outs = llm.generate(ps, SamplingParams(temperature=0.0, ignore_eos=True, **sp), use_tqdm=False,
                        lora_request=order)
    runner = model.__dict__.get("_cpu_layer_runner")  # built on the first step with it on
    assert runner or not on, "the layer runner does not cover this model"
    ran = (runner.lora_steps_run if runner else 0) - before
    assert (ran > 0) == (on and order is not None), f"runner {'on' if on else 'off'}: {ran} steps with adapter tokens"
    return outs


def test_runner_equals_loop_and_transformers_peft(wide_base):
    """fp32: the runner's logprobs equal the loop's within float32 summation noise (the kernel sums in
    another order than torch.mm), its greedy ids equal the loop's and transformers + PEFT's."""
    _runner_or_skip()
    _kernel_or_skip()
    arch, d, adapters = wide_base
    reqs, order = mixed(adapters)
    ps = prompts(vocab_of(d), 8)
    # 24-token steps: prefill chunks share steps with other requests' decodes
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory=8 << 20,
              max_num_batched_tokens=24, max_num_seqs=8)
    loop = _generate(llm, ps, order, False, max_tokens=MAX_TOKENS, logprobs=3)
    fused = _generate(llm, ps, order, True, max_tokens=MAX_TOKENS, logprobs=3)
    got = [o.outputs[0].token_ids for o in fused]
    assert got == [o.outputs[0].token_ids for o in loop]
    for f, lo in zip(fused, loop):
        for df, dl in zip(f.outputs[0].logprobs, lo.outputs[0].logprobs):
            assert df.keys() == dl.keys()
            for t in df:
                assert abs(df[t].logprob - dl[t].logprob) < 1e-4
    assert got == expected(d, order, ps), arch
    base_out = expected(d, [None] * 8, ps)
    assert all(got[i] != base_out[i] for i, lr in enumerate(order) if lr is not None)
    assert_pool_empty(llm)


@pytest.mark.parametrize("kw", [dict(quantization="int8", dtype="float32"), dict(dtype="bfloat16")])
def test_runner_with_int8_and_bf16_bases(wide_base, kw):
    """The int8 base (W8A8 on the packed panels, which the runner calls too) and bf16: the runner adds
    the adapters (its count says so) and its prompt logprobs stay within rounding of the loop's, far
    closer than the adapters move them."""
    _runner_or_skip()
    _kernel_or_skip()
    arch, d, adapters = wide_base
    if arch != "llama":
        pytest.skip("one base is enough")
    if kw["dtype"] == "bfloat16" and float_gemm_cpu._GEMM.get(torch.bfloat16) is None:
        pytest.skip("no bf16 packed GEMM on this CPU")
    reqs, order = mixed(adapters)
    ps = prompts(vocab_of(d), 8, seed=1)
    llm = LLM(d, enable_lora=True, max_loras=3, kv_cache_memory=8 << 20, max_num_batched_tokens=64, **kw)

    def lps(outs):
        return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, ps)]

    loop = lps(_generate(llm, ps, order, False, max_tokens=1, prompt_logprobs=0))
    fused = lps(_generate(llm, ps, order, True, max_tokens=1, prompt_logprobs=0))
    base = lps(_generate(llm, ps, None, True, max_tokens=1, prompt_logprobs=0))
    tol = 0.02 if kw["dtype"] == "float32" else 0.1
    for i, (f, lo, bo) in enumerate(zip(fused, loop, base)):
        err = sum(abs(a - b) for a, b in zip(f, lo)) / len(f)
        assert err < tol, (i, kw, err)
        if order[i] is not None:
            assert sum(abs(a - b) for a, b in zip(bo, lo)) / len(lo) > 5 * tol
    assert_pool_empty(llm)
