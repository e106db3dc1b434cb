"""The fused elementwise layers (add + RMSNorm, in-place RoPE with cos/sin gathered once, SiLU*mul)
against transformers' own Llama modules, on both paths: PyTorch ops ("torch": float32 and bfloat16
results equal bit for bit) and the C kernels of platforms/cpu/fused_ops.cpp ("c": RoPE and the residual
add bit for bit; RMSNorm and SiLU within the rounding bounds derived below, mostly bit-equal)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama import modeling_llama as hf

from pagedllm.config import get_rope_parameters
from pagedllm.layers.activation import silu_and_mul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
PATHS = ["torch", "c"]


@pytest.fixture
def path(request, monkeypatch):
    """Selects the implementation: "torch" turns the C kernels off, "c" requires them."""
    from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

    monkeypatch.setattr(cpu_fused_ops, "ENABLED", request.param == "c")  # PAGEDLLM_CPU_FUSED_OPS, read at import
    if request.param == "c":
        lib, err = cpu_fused_ops._LIBRARY.get()
        if lib is None:
            pytest.skip(f"the C kernels cannot be built here: {err}")
    return request.param


def assert_close_rounding(got, want, dtype, rtol32):
    """float32: within ``rtol32`` (the derived bound); bfloat16: within one bf16 step (2^-7 relative:
    a float value next to a rounding boundary landing on its other side), and at least 98% of
    elements equal (the bf16 rounding absorbs the float32 differences)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=rtol32, atol=1e-30)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-30)
        assert (got == want).float().mean().item() >= 0.98


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (48, 896)])
def test_rms_norm_and_fused_add_equal_transformers(dtype, shape, path):
    """The C kernel sums the squares in another order: a relative error of at most (hidden - 1)
    float32 steps on the sum (2^-24 each), half that through rsqrt, plus the 3 roundings of the
    products: rtol = hidden * 2^-24 covers it."""
    g = torch.Generator().manual_seed(shape[0])
    x, res = (torch.randn(*shape, generator=g) * 3).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    ref = hf.LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    ours = RMSNorm(shape[-1], 1e-5, dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    ref.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    rtol32 = shape[-1] * 2.0 ** -24
    with torch.no_grad():
        check = torch.equal if path == "torch" else lambda a, b: assert_close_rounding(a, b, dtype, rtol32) or True
        assert check(ours(x), ref(x))
        summed = res + x  # transformers' residual add
        residual = res.clone()
        out, new_res = ours(x, residual)
        assert new_res is residual and torch.equal(new_res, summed)  # updated in place
        assert check(out, ref(summed))


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 2, 64), (5, 16, 128), (48, 8, 128)])
def test_q_k_norm_per_head_in_place_equals_transformers(dtype, tokens, heads, head_dim, path):
    """Qwen3's q/k norms on views of the qkv projection's output (token stride > heads * head_dim):
    the C kernel normalizes each head's row in place and leaves the rest of each token's row (the
    other heads, k and v) untouched; the values as transformers' Qwen3RMSNorm, the bound of the
    test above."""
    from transformers.models.qwen3 import modeling_qwen3 as q3

    g = torch.Generator().manual_seed(tokens * heads)
    qkv = (torch.randn(tokens, (heads + 3) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[:, head_dim:(heads + 1) * head_dim].view(tokens, heads, head_dim)  # strided: not at column 0
    before = qkv.clone()
    ref = q3.Qwen3RMSNorm(head_dim, eps=1e-6).to(dtype)
    ours = RMSNorm(head_dim, 1e-6, dtype)
    w = torch.randn(head_dim, generator=g).to(dtype)
    ref.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    with torch.no_grad():
        want = ref(q.clone())
        got = ours.forward_heads_(q)
    if path == "torch":
        assert torch.equal(got, want) and torch.equal(qkv, before)  # a new tensor; the view untouched
        return
    assert got is q  # in place
    assert_close_rounding(got, want, dtype, head_dim * 2.0 ** -24)
    rest = torch.ones_like(qkv, dtype=torch.bool)
    rest[:, head_dim:(heads + 1) * head_dim] = False
    assert torch.equal(qkv[rest], before[rest])


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 640), (48, 1152)])
def test_gemma_norms_and_post_norm_adds_equal_transformers(dtype, shape, path):
    """Gemma's RMSNorm (x * rsqrt(mean(x^2) + eps) * (1 + w), in float) as transformers'
    Gemma3RMSNorm (the bound of the Llama norm's test): alone; as the post-norm residual add fused
    with the next norm, the add bit-exact given the norm's values (``residual + post_norm(branch)``,
    the norm rounded to the dtype before the add: half the rows sit at 256, where bf16's ties
    show a missing rounding); and on each head of a strided q view in place (Gemma 3's q/k norms),
    the rest of each row untouched."""
    from transformers.models.gemma3 import modeling_gemma3 as g3

    from pagedllm.layers.layernorm import GemmaRMSNorm

    g = torch.Generator().manual_seed(shape[-1])
    x, branch, res = ((torch.randn(*shape, generator=g) * 3).to(dtype) for _ in range(3))
    res[::2] = 256.0
    refs = [g3.Gemma3RMSNorm(shape[-1], eps=1e-6).to(dtype) for _ in range(2)]
    ours = [GemmaRMSNorm(shape[-1], 1e-6, dtype) for _ in range(2)]
    for r, o in zip(refs, ours):
        w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype)
        r.weight.data.copy_(w)
        o.weight.data.copy_(w)
    rtol32 = shape[-1] * 2.0 ** -24
    check = torch.equal if path == "torch" else lambda a, b: assert_close_rounding(a, b, dtype, rtol32) or True
    with torch.no_grad():
        assert check(ours[0](x), refs[0](x))
        normed = ours[0](branch)
        assert check(normed, refs[0](branch))
        residual = res.clone()
        got = ours[0].add_to_(residual, branch, ours[1])
        assert torch.equal(residual, res + normed)  # in place, rounded as transformers' sum
        assert check(got, refs[1](residual))
        residual = res.clone()
        assert ours[0].add_to_(residual, branch) is residual and torch.equal(residual, res + normed)

        heads, d = 4, 32
        qkv = (torch.randn(shape[0], (heads + 3) * d, generator=g) * 3).to(dtype)
        q = qkv[:, d:(heads + 1) * d].view(shape[0], heads, d)  # strided: a view of the qkv output
        before = qkv.clone()
        norm_d, mine_d = g3.Gemma3RMSNorm(d, eps=1e-6).to(dtype), GemmaRMSNorm(d, 1e-6, dtype)
        w = (torch.randn(d, generator=g) * 0.5).to(dtype)
        norm_d.weight.data.copy_(w)
        mine_d.weight.data.copy_(w)
        want = norm_d(q.clone())
        got = mine_d.forward_heads_(q)
        assert check(got, want)
        assert (got is q) == (path == "c")  # in place through the kernel
        rest = torch.ones_like(qkv, dtype=torch.bool)
        rest[:, d:(heads + 1) * d] = path != "c"
        assert torch.equal(qkv[rest], before[rest])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_equals_float64(dtype):
    """Gemma's GELU-tanh(gate) * up against the formula in float64, as g / (1 + exp(-2z)) (equal to
    0.5 g (1 + tanh z); PyTorch's 1 + tanh(z) loses digits to cancellation for g < 0 and reaches 0
    near g = -6 in float32, -7.5 in float64): float32 within
    1e-6 relative plus z's rounding through exp, and within 2^-21 |gate * up| of PyTorch's float32
    gelu (its cancellation); bfloat16 as the other tests. Rows strided, gates up to +-40."""
    from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

    if cpu_fused_ops._LIBRARY.get()[0] is None:
        pytest.skip("the C kernels cannot be built here")
    g = torch.Generator().manual_seed(6)
    buf = (torch.randn(300, 2 * 80 + 3, generator=g) * 8).to(dtype)
    buf[0, :4] = torch.tensor([-40.0, 40.0, 0.0, -0.0]).to(dtype)
    gate_up = buf[:, :2 * 80]
    gate, up = gate_up[:, :80].double(), gate_up[:, 80:].double()
    got = cpu_fused_ops.gelu_tanh_and_mul(gate_up)
    assert got.shape == (300, 80) and got.is_contiguous()
    z = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)
    gelu = gate / (1 + torch.exp(-2 * z))
    if dtype == torch.float32:
        # z carries ~4 float32 roundings (2^-22 relative), which exp(-2z) multiplies by |2z|
        bound = (1e-6 + 2.0 ** -22 * (2 * z).abs()) * (gelu * up).abs() + 1e-36
        assert ((got.double() - gelu * up).abs() <= bound).all()
        torch_form = (F.gelu(gate_up[:, :80], approximate="tanh") * gate_up[:, 80:]).double()
        assert ((got.double() - torch_form).abs() <= 2.0 ** -21 * (gate * up).abs() + 1e-30).all()
    else:  # the kernel rounds gelu(gate) to bf16, then the product, as transformers' bf16 MLP
        assert_close_rounding(got, (gelu.to(dtype).double() * up).to(dtype), dtype, 0.0)


def _hf_rope(config, positions, q, k, dtype):
    rope = hf.LlamaRotaryEmbedding(config)
    cos, sin = rope(q.to(dtype), positions[None])
    # transformers' layout: [B, H, N, D]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    qr, kr = hf.apply_rotary_pos_emb(qh, kh, cos, sin)
    return qr[0].transpose(0, 1), kr[0].transpose(0, 1)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("head_dim", [64, 16])  # 16: the kernel's one-vector-a-head float path
def test_rotary_in_place_equals_transformers(dtype, rope_scaling, path, head_dim):
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, rope_scaling=rope_scaling)
    n = 37
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 512, (n,), generator=g)
    # q and k as views of one fused qkv output, as the model produces them (non-contiguous rows).
    qkv = torch.randn(n, (4 + 2 + 2) * head_dim, generator=g).to(dtype)
    q = qkv[:, :4 * head_dim].view(n, 4, head_dim)
    k = qkv[:, 4 * head_dim:6 * head_dim].view(n, 2, head_dim)
    v_before = qkv[:, 6 * head_dim:].clone()
    want_q, want_k = _hf_rope(config, positions, q.clone(), k.clone(), dtype)
    rot = RotaryEmbedding(head_dim, 512, get_rope_parameters(config), dtype)
    copy_q, copy_k = rot(positions, q, k)  # the original API: new tensors, inputs unchanged
    assert torch.equal(copy_q, want_q) and torch.equal(copy_k, want_k)
    cos_sin = rot.cos_sin(positions)
    out_q, out_k = rot(positions, q, k, cos_sin=cos_sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 6 * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_transformers_mlp_product(dtype, path):
    """The C kernel's exp is a polynomial within ~2 float32 steps of exact, as is ATen's; with the
    division and the product, rtol = 16 * 2^-24 (float32). Rows strided, values up to +-40."""
    g = torch.Generator().manual_seed(5)
    buf = (torch.randn(300, 2 * 48 + 5, generator=g) * 8).to(dtype)
    buf[0, :4] = torch.tensor([-40.0, 40.0, 0.0, -0.0]).to(dtype)
    gate_up = buf[:, :2 * 48]  # rows of a larger buffer: row stride 101
    before = gate_up.clone()
    want = F.silu(gate_up[:, :48]) * gate_up[:, 48:]  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    got = silu_and_mul(gate_up)
    assert got.shape == (300, 48) and got.is_contiguous()
    if path == "torch":
        assert torch.equal(got, want)
    else:
        assert_close_rounding(got, want, dtype, 16 * 2.0 ** -24)
        assert torch.equal(gate_up, before)  # the input is left alone


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_quantize_and_epilogue_bit_equal(dtype, bias, path):
    """The int8 linear (W8A8) on either path equals its definition written in PyTorch ops bit for
    bit: per-token scales max(max|x|, 1e-12) / 127, values round_half_even(x * 127 / amax) (the
    reciprocal then a multiply, as PyTorch's 127 / tensor), float32 epilogue acc * sx * sw + bias
    rounded once to the activation dtype. Rows of 1-300 tokens, strided rows, an all-zero row."""
    from pagedllm.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel, set_int8_weight

    g = torch.Generator().manual_seed(3)
    for m, k, n in [(1, 576, 49152), (48, 1536, 576), (300, 64, 96), (5, 17, 40)]:
        wide = (torch.randn(m, 2 * k, generator=g) * torch.rand(m, 1, generator=g) * 8).to(dtype)
        x = wide[:, :k]  # rows strided
        x[m // 2] = 0
        layer = torch.nn.Module()
        set_int8_weight(layer, *quantize_per_channel(torch.randn(n, k, generator=g)))
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        got = Int8LinearMethod().apply(layer, x, b)
        amax = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12)
        xq = (x * (127 / amax)).round().to(torch.int8)
        want = torch._int_mm(xq, layer.weight_q).float() * (amax / 127) * layer.weight_scale
        want = (want + b if bias else want).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want), (m, k, n)


def test_decoder_layer_plain_forward_equals_fused(llama_dir):
    """The plain per-layer API (used by other model files) and the fused path agree, and the
    model shares one RoPE table across its layers."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader import load_model

    cfg = EngineArgs(model=llama_dir, dtype="float32", device="cpu").create_engine_config()
    model = load_model(cfg.model_config, "cpu", cfg.cache_config.block_size)
    assert all(layer.self_attn.rotary_emb is model.rotary_emb for layer in model.layers)
    from pagedllm.layers.attention import AttentionMetadata, PrefillSeq

    n = 11
    x = torch.randn(n, cfg.model_config.hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSeq(0, n, n)])
    pos = torch.arange(n)
    layer = model.layers[0]
    with torch.inference_mode():
        x_before = x.clone()
        plain = layer(pos, x, None, meta)
        assert torch.equal(x, x_before)  # the plain API leaves its input alone
        out, residual = layer.forward_fused(pos, x.clone(), None, None, meta, model.rotary_emb.cos_sin(pos))
        assert torch.equal(plain, out + residual)


def test_no_compiler_falls_back_to_pytorch_with_one_log_line(monkeypatch, tmp_path):
    """Without a C++ compiler the layers run their PyTorch code (same results) and say why once."""
    from pagedllm.platforms.cpu import build as cpu_build, fused_ops as cpu_fused_ops

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_fused_ops, "ENABLED", True)
    monkeypatch.setattr(cpu_fused_ops, "_LIBRARY", cpu_build.LazyLibrary(cpu_fused_ops._build))
    monkeypatch.setattr(cpu_fused_ops, "_logged_fallback", False)
    from conftest import pagedllm_logs
    with pagedllm_logs() as records:
        gate_up = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
        want = F.silu(gate_up[:, :16]) * gate_up[:, 16:]
        for _ in range(2):
            got = silu_and_mul(gate_up.clone())  # the PyTorch path overwrites its input's gate half
    assert torch.equal(got, want)
    lines = [r.getMessage() for r in records if "cpu fused ops" in r.getMessage()]
    assert len(lines) == 1 and "could not be built" in lines[0] and "no-such-compiler" in lines[0]


@pytest.mark.parametrize("path", ["c"], indirect=True)
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (4, 63), (4, 64), (3, 129), (256, 512), (48, 49152), (5, 100003)])
def test_argmax_rows_equals_torch_argmax(shape, path):
    from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(cpu_fused_ops.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(shape[0], shape[1] + 40)  # strided rows
    view = wide[:, 20:20 + shape[1]]
    assert torch.equal(cpu_fused_ops.argmax_rows(view), view.argmax(dim=-1))


@pytest.mark.parametrize("path", ["c"], indirect=True)
def test_argmax_rows_ties_infinities_and_nans_as_torch(path):
    """torch.argmax's rules: the first of equal maxima; a NaN beats every number, the first NaN
    wins; a row of -inf gives 0. Positions on both sides of a 16-lane boundary, in different chains of
    the max, and in the tail."""
    from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

    x = torch.randn(11, 1000)
    x[0, 10] = x[0, 500] = 100.0
    x[1, :] = float("-inf")
    x[2, 37] = x[2, 900] = float("nan")
    x[2, 5] = 1e30
    x[3, 999] = x[3, 3] = float("inf")
    x[4, 998] = float("nan")  # in the scalar tail (1000 = 62 * 16 + 8)
    x[5, :] = 0.0
    x[6, 15] = x[6, 16] = 50.0
    x[7, 994] = x[7, 999] = 50.0  # both in the tail
    x[8, :] = -1.0
    x[8, 700], x[8, 40], x[8, 900] = 0.0, -0.0, 0.0  # equal zeros: the first, whatever the max's sign
    x[9, 60] = x[9, 20] = float("nan")  # NaNs in different chains of the max
    x[10, 63] = x[10, 48] = 70.0  # equal maxima in the fourth and the first lanes of a 64-wide step
    got = cpu_fused_ops.argmax_rows(x)
    assert got.tolist()[:11] == [10, 0, 37, 3, 998, 0, 15, 994, 40, 20, 48]
    assert torch.equal(got, x.argmax(dim=-1))


def test_first_build_says_what_it_compiles_and_where_it_is_cached(monkeypatch, tmp_path):
    """A first build logs one line naming the source and the cached library's path; a second
    build of the same source finds the library and logs nothing."""
    import shutil

    from conftest import pagedllm_logs
    from pagedllm.platforms.cpu import build as cpu_build

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on this host")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny_kernel.cpp"
    source.write_text('extern "C" int tiny_answer() { return 42; }\n')
    flags = ["-O1", "-shared", "-fPIC"]
    with pagedllm_logs() as records:
        assert cpu_build.build_library(source, flags).tiny_answer() == 42
    lines = [r.getMessage() for r in records if "compiling" in r.getMessage()]
    built = list((tmp_path / "cache" / "kernels").glob("tiny_kernel-*.so"))
    assert len(lines) == 1 and len(built) == 1
    assert "tiny_kernel.cpp" in lines[0] and str(built[0]) in lines[0] and "cached" in lines[0]
    with pagedllm_logs() as records:
        assert cpu_build.build_library(source, flags).tiny_answer() == 42
    assert not [r for r in records if "compiling" in r.getMessage()]
