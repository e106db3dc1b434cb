"""The float GEMM of platforms/cpu/float_gemm.cpp: float32 and bfloat16 results against a float64
reference over the kernel's row tiles (1-24 rows, remainders), panel runs (1-4 panels a thread) and
a partial last panel, with and without bias, on strided rows; and the linear layer's use of it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu import float_gemm as float_gemm_cpu
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

_lib, _err = float_gemm_cpu._LIBRARY.get()
LEVEL = _lib.float_gemm_level() if _lib is not None else 0
needs = {torch.float32: pytest.mark.skipif(LEVEL < 1, reason=f"no float GEMM here (AVX-512 or AVX2 + FMA) ({_err or 'level 0'})"),
         torch.bfloat16: pytest.mark.skipif(LEVEL < 2, reason="no bf16 GEMM here (AVX512-BF16, or AVX2 + FMA without AVX-512)")}
DTYPES = [pytest.param(torch.float32, marks=needs[torch.float32]),
          pytest.param(torch.bfloat16, marks=needs[torch.bfloat16])]


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b) -> None:
    """float32: within 8 float32 epsilons of sum_k |x||w| (a K-long float32 sum's rounding; a
    wrong element or layout is off by O(1)). bfloat16: the float32 sum rounded once to bfloat16,
    so also within a bfloat16 step (2^-8) of the value."""
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    bound = 8 * 1.2e-7 * scale + (ref.abs() * 2 ** -8 if y.dtype == torch.bfloat16 else 0)
    bad = (y.double() - ref).abs() > bound + 1e-30
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(16, 8), (70, 77), (96, 64), (200, 33), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_reference(dtype, n, k, bias):
    torch.manual_seed(n * 100 + k)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    packed = float_gemm_cpu.pack(w)
    assert packed.numel() == float_gemm_cpu.packed_elems(n, k, dtype)
    for m in (1, 2, 5, 6, 7, 12, 13, 24, 25, 48):
        x = torch.randn(m, k + 5).to(dtype)[:, 2:2 + k]  # strided rows, offset start
        y = float_gemm_cpu.linear(x, packed, b, n)
        assert y.shape == (m, n) and y.dtype == dtype and y.is_contiguous()
        _check(y, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [767, 768, 1000, 2048])
def test_prefill_sized_steps(dtype, m):
    """Prefill-sized row counts (on AVX2 from 768 rows x is taken 192 rows at a time, each block
    against all of a thread's panels): the same bounds, a last block of 40 rows at 1,000, and the
    same bits as the rows computed 48 at a time (each element is one tile's sum in k order)."""
    torch.manual_seed(m)
    n, k = 200, 96
    w, b, x = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype), torch.randn(m, k).to(dtype)
    packed = float_gemm_cpu.pack(w)
    y = float_gemm_cpu.linear(x, packed, b, n)
    _check(y, x, w, b)
    assert torch.equal(y, torch.cat([float_gemm_cpu.linear(x[i:i + 48], packed, b, n) for i in range(0, m, 48)]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_share_out_panels(dtype):
    """1, 2 and 3 threads split 9 panels (runs of 4, 3, 2 and 1) and give the same bits: each
    output element is one thread's sum in the same order."""
    torch.manual_seed(1)
    n, k = 140, 40  # 8 full panels and a 12-column one
    w, x = torch.randn(n, k).to(dtype), torch.randn(30, k).to(dtype)
    packed = float_gemm_cpu.pack(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(float_gemm_cpu.linear(x, packed, None, n))
    finally:
        torch.set_num_threads(before)
    _check(outs[0], x, w, None)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs[torch.float32]
def test_mismatch_raises():
    packed = float_gemm_cpu.pack(torch.randn(32, 8))
    with pytest.raises(ValueError, match="features"):
        float_gemm_cpu.linear(torch.randn(3, 9), packed, None, 32)
    with pytest.raises(ValueError, match="dtypes"):
        float_gemm_cpu.linear(torch.randn(3, 8).to(torch.bfloat16), packed, None, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layer_uses_it(dtype, monkeypatch):
    """A layer wide enough (64 columns a thread) is packed for this kernel, its float copy released;
    the output matches F.linear; with the switch off it stays on the oneDNN (or plain) path."""
    from torch import nn

    torch.manual_seed(2)
    n, k = 64 * torch.get_num_threads() + 8, 48

    def make():
        layer = nn.Module()
        UnquantizedLinearMethod().create_weights(layer, k, n, True, dtype)
        layer.weight.data.normal_()
        layer.bias.data.normal_()
        return layer

    layer = make()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    method = UnquantizedLinearMethod()
    method.process_weights_after_loading(layer)
    assert hasattr(layer, "gemm_weight") and not hasattr(layer, "packed_weight")
    assert layer.weight.numel() == 0 and layer.packed_bytes == layer.gemm_weight.numel() * layer.gemm_weight.element_size()
    calls = []
    real = float_gemm_cpu.linear
    monkeypatch.setattr(float_gemm_cpu, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 5, k).to(dtype)
    y = method.apply(layer, x, layer.bias)
    assert calls and y.shape == (3, 5, n)
    _check(y.reshape(15, n), x.reshape(15, k), w, b)

    monkeypatch.setattr(float_gemm_cpu, "ENABLED", False)
    off = make()
    method.process_weights_after_loading(off)
    assert not hasattr(off, "gemm_weight")
    assert not float_gemm_cpu.supported(w)


@needs[torch.float32]
def test_narrow_layer_keeps_onednn():
    """Under 64 columns a thread the layer is not packed for this kernel."""
    assert not float_gemm_cpu.supported(torch.randn(64 * torch.get_num_threads() - 16, 8))
    assert float_gemm_cpu.supported(torch.randn(64 * torch.get_num_threads(), 8))
    assert not float_gemm_cpu.supported(torch.randn(256, 8).to(torch.float16))
