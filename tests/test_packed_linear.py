"""float32 and bfloat16 linear layers on a CPU run on oneDNN-packed weights (layers/quantization/unquantized.py):
same results as F.linear within float32 rounding, the float copy released except the tied LM head,
and PAGEDLLM_CPU_PACKED_LINEAR=0 keeps the plain path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms.cpu import float_gemm as float_gemm_cpu
from pagedllm.platforms.cpu.ops import can_pack as _can_pack
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod


def _layer(out_f: int, in_f: int, bias: bool, dtype=torch.float32) -> nn.Module:
    layer = nn.Module()
    UnquantizedLinearMethod().create_weights(layer, in_f, out_f, bias, dtype)
    torch.manual_seed(0)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


@pytest.mark.skipif(not _can_pack(torch.zeros(2, 2)), reason="this PyTorch build has no oneDNN linear")
@pytest.mark.parametrize("rows", [1, 7, 48, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_f_linear(rows, dtype, monkeypatch):
    """float32: equal within float32 rounding of a 64-term sum. bfloat16: both accumulate in float32
    and round once to bfloat16, so they differ by at most a bfloat16 step or two (2^-8 relative).
    Our own panel GEMM (tests/test_float_gemm.py) is switched off: this is oneDNN's path."""
    monkeypatch.setattr(float_gemm_cpu, "ENABLED", False)
    method = UnquantizedLinearMethod()
    layer = _layer(96, 64, bias=True, dtype=dtype)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    method.process_weights_after_loading(layer)
    x = torch.randn(rows, 64).to(dtype)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN refuses bfloat16 without AVX-512 (an AVX2-only host): the layer keeps the plain path.
        assert not hasattr(layer, "packed_weight") and torch.equal(layer.weight, w)
        assert torch.equal(method.apply(layer, x, layer.bias), F.linear(x, w, b))
        return
    assert hasattr(layer, "packed_weight") and layer.weight.numel() == 0      # the float copy is released
    assert layer.packed_weight.dtype == dtype
    got = method.apply(layer, x, layer.bias)
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got, F.linear(x, w, b), **tol)
    assert method.apply(layer, x.view(rows, 1, 64), layer.bias).shape == (rows, 1, 96)


def test_switch_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_LINEAR", "0")
    layer = _layer(8, 4, bias=False)
    UnquantizedLinearMethod().process_weights_after_loading(layer)
    assert not hasattr(layer, "packed_weight") and layer.weight.numel() == 32
