"""The op seam (pagedllm/platforms/ops.py): each op runs the current platform's body first and its
native torch body where that returns None; the platform is bound on first use; a platform with no
kernels (``PlatformOps``) runs every layer on the native bodies, with the CPU kernels' results
(bit for bit where the kernels promise it: RoPE, the residual add, argmax, the int8 path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import platforms
from pagedllm.layers.activation import silu_and_mul
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import Int8Config, process_weights_after_loading
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.platforms import ops
from pagedllm.platforms.interface import PlatformOps


@pytest.fixture
def native(monkeypatch):
    """The seam bound to a platform without kernels (every op on its torch body)."""
    monkeypatch.setattr(ops, "_OPS", PlatformOps)


def test_seam_binds_the_current_platform_on_first_use(monkeypatch):
    monkeypatch.setattr(ops, "_OPS", ops._Unresolved())
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    assert ops._OPS is platforms.current_platform.ops


def test_platform_body_first_native_where_it_returns_none(monkeypatch):
    marker = torch.full((2, 4), 7.0)
    calls = []

    class Ops(PlatformOps):
        @staticmethod
        def rms_norm(x, weight, eps, residual=None):
            calls.append(residual is None)
            return marker if x.shape[0] == 2 else None

    monkeypatch.setattr(ops, "_OPS", Ops)
    w = torch.randn(4)
    assert ops.rms_norm(torch.randn(2, 4), w, 1e-6) is marker
    x = torch.randn(3, 4)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm_native(x, w, 1e-6))
    res = torch.randn(3, 4)
    want_res = res + x
    out, got_res = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert got_res is res and torch.equal(res, want_res) and torch.equal(out, ops.rms_norm_native(want_res, w, 1e-6))
    assert calls == [True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_on_the_native_platform_equal_the_cpu_kernels(dtype, monkeypatch):
    """RoPE and the residual add bit for bit; the norms and SiLU within one step of the dtype (the
    kernels sum in another order: tests/test_fused_layers.py derives the bounds)."""
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(6, 64, generator=g) * 3).to(dtype), torch.randn(6, 64, generator=g).to(dtype)
    norm, gnorm, gnext = RMSNorm(64, 1e-5, dtype), GemmaRMSNorm(64, 1e-6, dtype), GemmaRMSNorm(64, 1e-6, dtype)
    qnorm, gqnorm = RMSNorm(16, 1e-5, dtype), GemmaRMSNorm(16, 1e-6, dtype)
    for m in (norm, gnorm, gnext, qnorm, gqnorm):
        m.weight.data.copy_(torch.randn(m.weight.shape[0], generator=g).to(dtype) * 0.1)
    rope = RotaryEmbedding(16, 64, {"rope_theta": 10000.0}, dtype)
    qkv = torch.randn(6, 5, 16, generator=g).to(dtype)
    cs = rope.cos_sin(torch.arange(6))
    gate_up = torch.randn(6, 2 * 48, generator=g).to(dtype)

    def run():
        r1, r2 = res.clone(), res.clone()
        out, r1 = norm(x, r1)
        heads = qkv.clone()
        return dict(norm=norm(x), add=out, residual=r1, gemma=gnorm(x), gemma_add=gnorm.add_to_(r2, x, gnext),
                    gemma_residual=r2, heads=qnorm.forward_heads_(heads[:, 1:3]).clone(),
                    gemma_heads=gqnorm.forward_heads_(qkv.clone()[:, 3:]).clone(),
                    rope=rope.apply_(qkv.clone()[:, :3], cs).clone(), silu=silu_and_mul(gate_up.clone()),
                    gelu=ops.gelu_tanh_and_mul(gate_up))

    fast = run()
    monkeypatch.setattr(ops, "_OPS", PlatformOps)
    slow = run()
    assert torch.equal(slow["silu"], F.silu(gate_up[:, :48]) * gate_up[:, 48:])
    for name in ("residual", "rope"):
        assert torch.equal(fast[name], slow[name]), name
    for name, want in slow.items():
        torch.testing.assert_close(fast[name].float(), want.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_native_platform_same_bits(dtype, monkeypatch):
    """An int8 layer built and run on a platform without kernels (no panels: torch._int_mm and the
    torch epilogue) gives the CPU platform's output to the bit, at decode and prefill row counts."""
    torch.manual_seed(0)
    n, k = 64 * torch.get_num_threads() + 24, 96
    w, b = torch.randn(n, k), torch.randn(n)

    def build():
        layer = ColumnParallelLinear(k, n, bias=True, dtype=dtype, quant_config=Int8Config())
        layer.weight_loader(layer.weight, w.to(dtype))
        layer.bias.weight_loader(layer.bias, b.to(dtype))
        process_weights_after_loading(layer, Int8Config())
        return layer

    xs = [torch.randn(m, k).to(dtype) for m in (1, 3, 48, 200)]
    cpu_layer = build()
    fast = [cpu_layer(x) for x in xs]
    monkeypatch.setattr(ops, "_OPS", PlatformOps)
    plain = build()
    assert getattr(plain, "weight_packed", None) is None and plain.weight_q.shape == (k, n)
    for x, want in zip(xs, fast):
        got = plain(x)
        assert got.dtype == dtype and torch.equal(got, want), x.shape[0]


def test_float_linear_native_platform_keeps_f_linear(native):
    layer = ColumnParallelLinear(8, 64 * torch.get_num_threads(), bias=False, dtype=torch.float32)
    layer.weight.data.normal_()
    process_weights_after_loading(layer, None)
    assert getattr(layer, "gemm_weight", None) is None and getattr(layer, "packed_weight", None) is None
    x = torch.randn(5, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_native_int8_ops(native):
    a = torch.randint(-127, 128, (3, 40), dtype=torch.int8)
    w = torch.randint(-127, 128, (24, 40), dtype=torch.int8)
    assert torch.equal(ops.int8_mm(a, w.t(), ops.int8_row_sums(w)), (a.long() @ w.long().t()).int())
    assert ops.int8_pack_panels(w) is None and not ops.int8_panels_only()
    with pytest.raises(RuntimeError, match="no int8 panels"):
        ops.int8_panel_gemm(a, torch.empty(0, dtype=torch.int8), ops.int8_row_sums(w), 24)
    x = torch.randn(4, 40)
    x[1] = 0
    q, s = ops.quantize_per_token(x)
    assert q.dtype == torch.int8 and q[1].abs().sum() == 0 and s[1].item() == pytest.approx(ops.INT8_TINY / 127)
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-7).all()
