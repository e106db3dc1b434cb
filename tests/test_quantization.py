"""W8A8 int8 quantization (``--quantization int8``): the quantized linear stays within the error
bound the method allows, int32 matmuls are exact and batch invariant, greedy ids of an int8 model
do not depend on batching, chunked prefill, preemption or prefix caching, TP=2 equals TP=1, and
GGUF Q8_0 blocks convert to per-channel int8."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_pool_empty, build_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import (Int8Config, Int8LinearMethod, UnquantizedLinearMethod,
                                          get_quantization_config, process_weights_after_loading)
from pagedllm.layers.quantization import int8
from pagedllm.layers.quantization.int8 import int8_mm, quantize_per_channel, quantize_per_token
from pagedllm.layers.quantization.q8_0 import q8_0_to_int8_per_channel, set_q8_0_weight, split_q8_0
from pagedllm.layers.vocab_embedding import ParallelLMHead
from test_correctness import make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def int8_error_bound(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, group: int = 0) -> torch.Tensor:
    """Bound on |y_int8 - x W^T| [m, n] for activation scales per token and per group of ``group``
    features (0: one per token), sx = max |x| of the group / 127, and weight scales sw [n].

    With x = sx xq + ex, W = sw wq + ew and |ex| <= sx / 2, |ew| <= sw / 2 elementwise (round to
    nearest), x W^T - sum_g sx_g sw xq_g wq_g^T = sum_k (x ew + ex w - ex ew), so per group g
    |error_g| <= sw/2 sum_{k in g} |x| + sx_g/2 sum_{k in g} |w| + |g| sx_g sw / 4, summed over groups.
    The int32 sums are exact; the float reference and the scale products add a relative 1e-5 of
    sum_k |x||w| (fp32 rounding, k <= 2048)."""
    m, k = x.shape
    g = group if group and k % group == 0 else k
    ax, aw = x.abs().double(), w.abs().double()
    sw = sw.double().reshape(1, -1)
    bound = 1e-5 * ax @ aw.t()
    for i in range(0, k, g):
        axg, awg = ax[:, i:i + g], aw[:, i:i + g]
        sx = axg.amax(1, keepdim=True) / 127
        bound += sw / 2 * axg.sum(1, keepdim=True) + sx / 2 * awg.sum(1).reshape(1, -1) + g * sx * sw / 4
    return bound


def make_linear(cls, *args, group: int = 64, **kw):
    """A layer built with an explicit int8 config (``layer.cfg``: pass it to the post-load step too)."""
    cfg = Int8Config(act_group_size=group)
    layer = cls(*args, quant_config=cfg, **kw)
    layer.cfg = cfg
    assert isinstance(layer.quant_method, Int8LinearMethod)
    return layer


@pytest.mark.parametrize("group", [0, 64])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 100, 30), (48, 576, 192), (130, 256, 520)])
def test_int8_linear_within_derived_bound(m, k, n, group):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    x[0, 3] = 25.0  # an outlier inflates one token's scale: the bound must follow it
    w = torch.randn(n, k, generator=g) * 0.05
    w[1] *= 10  # and one output channel's scale
    b = torch.randn(n, generator=g)
    layer = make_linear(ColumnParallelLinear, k, n, bias=True, group=group)
    layer.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    process_weights_after_loading(layer, layer.cfg)
    assert layer.weight_q.dtype == torch.int8 and not hasattr(layer, "weight")
    y = layer(x)
    ref = x.double() @ w.double().t() + b.double()
    err = (y.double() - ref).abs()
    bound = int8_error_bound(x, w, w.abs().amax(1) / 127, group)
    assert (err <= bound).all(), float((err / bound).max())
    assert err.max() > 0  # really quantized
    # The bound is not vacuous: the error stays a small fraction of the output's scale.
    assert err.max() < 0.05 * ref.abs().max()


def test_quantize_per_token_rows_are_independent():
    x = torch.randn(6, 40)
    x[2] = 0.0  # an all-zero row quantizes to zeros
    x[4, 7] = -1e4
    q, s = quantize_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (6, 1)
    assert q.abs().amax(1)[[0, 1, 3, 4, 5]].eq(127).all() and q[2].eq(0).all()
    assert ((q.float() * s - x).abs() <= s / 2 * (1 + 1e-6)).all()
    for i in range(6):
        qi, si = quantize_per_token(x[i:i + 1])
        assert torch.equal(qi, q[i:i + 1]) and torch.equal(si, s[i:i + 1])
    wq, ws = quantize_per_channel(x)
    assert torch.equal(wq, q) and torch.allclose(ws, s[:, 0])


@pytest.mark.parametrize("m", [1, 5, 17, 48, 200])
def test_int_mm_is_exact_and_batch_invariant(m):
    g = torch.Generator().manual_seed(m)
    a = torch.randint(-127, 128, (200, 576), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (1536, 576), dtype=torch.int8, generator=g)
    from pagedllm.layers.quantization.int8 import int8_weight_layout

    b = int8_weight_layout(w)
    full = int8_mm(a, b)
    assert torch.equal(full, (a.long() @ w.long().t()).int())
    rows = torch.randperm(200, generator=g)[:m]
    assert torch.equal(int8_mm(a[rows].contiguous(), b), full[rows])


def _panels_or_skip():
    """The int8 library with its panel GEMM (AVX512-VNNI or AVX2), or a skip."""
    from pagedllm.platforms.cpu import int8_gemm as int8_gemm_cpu

    lib, why = int8_gemm_cpu._LIBRARY.get()
    if lib is None:
        pytest.skip(f"int8 panel GEMM unavailable: {why}")
    return int8_gemm_cpu


def _vnni_or_skip():
    """The int8 library with its small-batch kernel too (AVX512-VNNI only), or a skip."""
    g8 = _panels_or_skip()
    if not g8._LIBRARY.get()[0].small_batch:
        pytest.skip("small-batch int8 kernel unavailable: this CPU (or compiler) has no AVX512-VNNI")
    return g8


@pytest.mark.parametrize("k", [576, 70, 1, 130])
@pytest.mark.parametrize("n", [1, 7, 16, 49])
def test_small_batch_int8_gemm_is_exact(k, n, monkeypatch):
    """The VNNI kernel (u8 x s8 with a +128 offset undone through the weight's row sums) equals the
    exact integer product for every row count it takes and every tile remainder: k not a multiple
    of 64 (masked tail), n not a multiple of a tile's columns, rows strided, extreme values."""
    g8 = _vnni_or_skip()
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    w[0] = 127  # the largest |partial sums|
    wsum = g8.weight_row_sums(w)
    assert torch.equal(wsum, w.long().sum(1).int())
    lo, hi = g8.MIN_ROWS, g8.MAX_ROWS
    monkeypatch.setattr(g8, "MIN_ROWS", 1)  # one row too: the kernel's 1 x 16 tile
    for m in range(1, hi + 1):
        base = torch.randint(-127, 128, (m, k + 9), dtype=torch.int8, generator=g)
        base[0, :k] = -127
        a = base[:, 3:3 + k]  # rows strided (stride k + 9)
        out = g8.int8_gemm(a, w, wsum)
        assert out is not None and out.dtype == torch.int32
        assert torch.equal(out, (a.long() @ w.long().t()).int()), m
    monkeypatch.setattr(g8, "MIN_ROWS", lo)
    for m in (lo - 1, hi + 1):  # fewer or more rows: torch._int_mm
        assert g8.int8_gemm(torch.zeros(m, k, dtype=torch.int8), w, wsum) is None


@pytest.mark.parametrize("k,n", [(576, 200), (70, 16), (1, 33), (130, 7)])
def test_panel_int8_gemm_is_exact(k, n):
    """The packed-panel GEMM (VNNI, or AVX2) equals the exact integer product over row tiles and
    their remainders (1-30 rows; VNNI: 6 a tile at 4 panels, 8, 12 or 24 at fewer; AVX2: 6 as
    3 + 3), panel runs of 1-4 a thread, a partial last panel (n % 16), k not a multiple of 4,
    strided rows and extreme values (activations of -128 too)."""
    g8 = _panels_or_skip()
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    w[0] = 127
    packed, wsum = g8.panel_pack(w), g8.weight_row_sums(w)
    assert packed.numel() == -(-n // 16) * 64 * -(-k // 4)
    for m in (1, 2, 5, 6, 7, 12, 13, 24, 25, 30):
        base = torch.randint(-128, 128, (m, k + 9), dtype=torch.int8, generator=g)
        base[0, :k] = -128
        a = base[:, 3:3 + k]
        out = g8.panel_gemm(a, packed, wsum, n)
        assert out.dtype == torch.int32 and torch.equal(out, (a.long() @ w.long().t()).int()), m
    with pytest.raises(ValueError):
        g8.panel_gemm(torch.zeros(2, k + 4, dtype=torch.int8), packed, wsum, n)


def test_int8_lm_head_runs_on_packed_panels(monkeypatch):
    """The int8 LM head is packed for the panel GEMM (weight_q released, its bytes counted) and
    gives the same logits, to the bit, as the same head left on torch._int_mm."""
    g8 = _panels_or_skip()
    from pagedllm.layers.quantization import int8
    from pagedllm.layers.vocab_embedding import ParallelLMHead

    torch.manual_seed(0)
    vocab, hidden = 64 * torch.get_num_threads() + 40, 48
    w = torch.randn(vocab, hidden)

    def head():
        h = ParallelLMHead(vocab, hidden, torch.float32, quant_config=int8.Int8Config())
        h.weight.data.copy_(w)
        h.quant_method.process_weights_after_loading(h)
        return h

    packed = head()
    monkeypatch.setattr(int8, "pack_weight", lambda layer: None)
    plain = head()
    assert hasattr(packed, "weight_packed") and packed.weight_q.numel() == 0
    assert packed.packed_bytes == packed.weight_packed.numel() >= vocab * hidden
    assert not hasattr(plain, "weight_packed") and plain.weight_q.shape == (hidden, vocab)
    for m in (1, 3, 48):
        x = torch.randn(m, hidden)
        assert torch.equal(packed.quant_method.apply(packed, x), plain.quant_method.apply(plain, x)), m


def test_panel_unpack_gives_the_weight_back():
    g8 = _panels_or_skip()
    for n, k in ((16, 4), (200, 96), (1003, 343), (37, 5)):
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
        assert torch.equal(g8.panel_unpack(g8.panel_pack(w), n, k), w), (n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_same_bits_as_quantize_gemm_epilogue(dtype):
    """The one-call W8A8 linear equals its three steps (per-row quantization, the panel GEMM, the
    float epilogue) to the bit: strided rows, an all-zero row, with and without bias, row counts
    across the register tiles."""
    g8 = _panels_or_skip()
    from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops

    gen = torch.Generator().manual_seed(7)
    for n, k in ((64 * torch.get_num_threads() + 40, 99), (576, 1536)):
        q, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
        packed, wsum = g8.panel_pack(q), g8.weight_row_sums(q)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            for m in (1, 5, 13, 48):
                x = (torch.randn(m, 2 * k, generator=gen) * 4).to(dtype)[:, 1:1 + k]
                x[m // 2] = 0
                got = g8.panel_linear(x, packed, wsum, scale, bias)
                xq, sx = quantize_per_token(x)
                want = cpu_fused_ops.int8_epilogue(g8.panel_gemm(xq, packed, wsum, n), sx, scale, bias, dtype)
                assert got.dtype == dtype and torch.equal(got, want), (n, k, m, bias is None)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_int8_layers_same_bits_as_int_mm_at_every_row_count(monkeypatch, bias):
    """Column- and row-parallel int8 layers packed for the panel GEMM (weight_q released, the
    panels' bytes counted, weight_matrix unpacking the same int8 weight) give the same output, to
    the bit, as the same layers left on torch._int_mm: on the panels (the one-call linear) up to
    PANEL_MAX_ROWS rows, through the unpacked weight above it (on an AVX2 CPU without VNNI, where
    torch._int_mm is a reference loop: on the panels at every row count)."""
    g8 = _panels_or_skip()
    torch.manual_seed(0)
    n = 64 * torch.get_num_threads() + 72  # 16-column panels with a partial last one
    k = 99  # not a multiple of 4
    w1, w2 = torch.randn(n, k), torch.randn(k, n)
    b1, b2 = torch.randn(n), torch.randn(k)

    def build():
        col = make_linear(ColumnParallelLinear, k, n, bias=bias, group=0)
        col.weight_loader(col.weight, w1)
        row = make_linear(RowParallelLinear, n, k, bias=bias, group=0)
        row.weight_loader(row.weight, w2)
        if bias:
            col.bias.weight_loader(col.bias, b1)
            row.bias.weight_loader(row.bias, b2)
        for layer in (col, row):
            process_weights_after_loading(layer, layer.cfg)
        return col, row

    col, row = build()
    with monkeypatch.context() as mp:
        mp.setattr(int8, "pack_weight", lambda layer: None)
        plain_col, plain_row = build()
    assert hasattr(col, "weight_packed") and col.weight_q.numel() == 0 and col.packed_bytes == col.weight_packed.numel()
    assert torch.equal(int8.weight_matrix(col), plain_col.weight_q)
    assert not hasattr(row, "weight_packed")  # k = 99 columns: fewer than 64 a thread
    calls = {"panel": 0, "unpacked": 0}
    real_linear, real_matrix = g8.panel_linear, int8.weight_matrix
    monkeypatch.setattr(g8, "panel_linear", lambda *a: calls.__setitem__("panel", calls["panel"] + 1) or real_linear(*a))
    monkeypatch.setattr(int8, "weight_matrix", lambda l: calls.__setitem__("unpacked", calls["unpacked"] + 1) or real_matrix(l))
    cap = int8.PANEL_MAX_ROWS
    for m in (1, 3, cap, cap + 1, 200):
        x = torch.randn(m, k)
        assert torch.equal(row(col(x)), plain_row(plain_col(x))), m
    assert calls == ({"panel": 5, "unpacked": 0} if g8.int_mm_is_slow() else {"panel": 3, "unpacked": 2})


def test_int8_linear_same_bits_with_and_without_the_small_batch_kernel(monkeypatch):
    """A decode-sized int8 linear gives the same output through the VNNI kernel as through
    torch._int_mm, merged and row-parallel layers included (weight_sum is set at load)."""
    g8 = _vnni_or_skip()
    torch.manual_seed(0)
    w1, w2 = torch.randn(200, 96), torch.randn(96, 200)
    col = make_linear(ColumnParallelLinear, 96, 200, bias=True, group=0)
    col.weight_loader(col.weight, w1)
    col.bias.weight_loader(col.bias, torch.randn(200))
    row = make_linear(RowParallelLinear, 200, 96, bias=False, group=0)
    row.weight_loader(row.weight, w2)
    layers = [col, row]
    monkeypatch.setattr(int8, "pack_weight", lambda layer: None)  # the small kernel reads weight_q in place
    for layer in layers:
        process_weights_after_loading(layer, layer.cfg)
        assert torch.equal(layer.weight_sum, layer.weight_q.t().long().sum(1).int())
    calls = []
    real = g8.int8_gemm
    def counted(*args):  # the kernel's runs (it returns None where it does not apply)
        out = real(*args)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(g8, "int8_gemm", counted)
    for m in (2, 3, 5):
        x = torch.randn(m, 96)
        fast = layers[1](layers[0](x))
        monkeypatch.setattr(g8, "MAX_ROWS", 0)
        slow = layers[1](layers[0](x))
        monkeypatch.setattr(g8, "MAX_ROWS", 5)
        assert torch.equal(fast, slow)
    assert len(calls) == 6  # two layers x three batches, none while MAX_ROWS was 0


def test_row_parallel_and_merged_layers_quantize():
    x = torch.randn(9, 64)
    w = torch.randn(32, 64)
    row = make_linear(RowParallelLinear, 64, 32, bias=True)
    row.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, torch.ones(32))
    merged = make_linear(MergedColumnParallelLinear, 64, [16, 16])
    merged.weight_loader(merged.weight, w[:16], 0)
    merged.weight_loader(merged.weight, w[16:], 1)
    for layer in (row, merged):
        process_weights_after_loading(layer, layer.cfg)
    bound = int8_error_bound(x, w, w.abs().amax(1) / 127, 64)
    assert ((row(x) - 1 - x @ w.t()).abs() <= bound).all()
    assert ((merged(x) - x @ w.t()).abs() <= bound).all()


def test_lm_head_quantized_unless_skipped():
    head = ParallelLMHead(100, 32, quant_config=Int8Config())
    head.weight.data.copy_(torch.randn(100, 32))
    w = head.weight.detach().clone()
    process_weights_after_loading(head, Int8Config())
    h = torch.randn(3, 32)
    bound = int8_error_bound(h, w, w.abs().amax(1) / 127, 64)
    logits = head.compute_logits(h)
    assert logits.shape == (3, 100) and ((logits - h @ w.t()).abs() <= bound).all()
    for cfg, prefix in ((Int8Config(quantize_lm_head=False), ""), (Int8Config(ignore=["lm_head"]), "lm_head")):
        skipped = ParallelLMHead(100, 32, quant_config=cfg, prefix=prefix)
        assert isinstance(skipped.quant_method, UnquantizedLinearMethod)
    # Prefix binding at load time: a model built without prefixes still honours "ignore".
    model = torch.nn.ModuleDict({"lm_head": ParallelLMHead(100, 32), "proj": ColumnParallelLinear(32, 8)})
    report = process_weights_after_loading(model, Int8Config(ignore=["lm_head"]))
    assert isinstance(model["lm_head"].quant_method, UnquantizedLinearMethod)
    assert isinstance(model["proj"].quant_method, Int8LinearMethod) and report.num_quantized == 1
    assert report.bytes_saved == 8 * 32 * 4 - (8 * 32 + 8 * 4)


def test_unknown_quantization_is_a_clear_error(llama_dir):
    assert get_quantization_config(None) is None and get_quantization_config("none") is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(llama_dir, quantization="int4", kv_cache_memory=1 << 20)


# ---- GGUF Q8_0 -> per-channel int8 --------------------------------------------------------------
def test_q8_0_requantizes_within_bound_and_keeps_uniform_rows_exact():
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-2, 0, 128)  # block scales differ along k
    w[5] = torch.randn(128, generator=g).sign() * 0.3  # every block has amax 0.3: one shared scale
    raw = gguf.quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    deq = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q8_0).copy()).float()
    qs, d = split_q8_0(raw)
    assert qs.shape == (24, 128) and d.shape == (24, 4)
    assert torch.equal(qs.float().reshape(24, 4, 32).mul(d.float()[:, :, None]).reshape(24, 128), deq)
    q, scale = q8_0_to_int8_per_channel(qs, d)
    assert q.dtype == torch.int8 and scale.shape == (24,)
    err = (q.float() * scale[:, None] - deq).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(q[5], qs[5]) and scale[5] == d[5, 0].float()  # kept exactly
    assert err[5].max() == 0

    layer = make_linear(ColumnParallelLinear, 128, 24)
    set_q8_0_weight(layer, raw)
    process_weights_after_loading(layer, layer.cfg)  # keeps the Q8_0-derived weights
    assert torch.equal(layer.weight_scale, scale)
    x = torch.randn(5, 128, generator=g)
    bound = int8_error_bound(x, deq, scale, 64)
    assert ((layer(x) - x @ deq.t()).abs() <= bound).all()


def test_q8_0_rejects_bad_rows():
    with pytest.raises(ValueError, match="Q8_0 data"):
        split_q8_0(torch.zeros(2, 35, dtype=torch.uint8))


# ---- SmoothQuant ---------------------------------------------------------------------------------
def _load(path: str, quantization=None, dtype: str = "float32"):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader import load_model

    cfg = EngineArgs(model=path, dtype=dtype, quantization=quantization).create_engine_config()
    return load_model(cfg.model_config, "cpu", cfg.cache_config.block_size)


def _logits(model, seqs) -> torch.Tensor:
    from pagedllm.layers.attention import AttentionMetadata, PrefillSeq

    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s))
    meta = AttentionMetadata(slot_mapping=torch.arange(starts[-1]),
                             prefills=[PrefillSeq(starts[i], starts[i + 1], len(s)) for i, s in enumerate(seqs)])
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, [None] * len(model.layers), meta))


@pytest.mark.parametrize("arch,dtype,tied", [("llama", "float32", False), ("qwen2", "float32", False),
                                             ("qwen3", "float32", False), ("llama", "bfloat16", False),
                                             ("llama", "float32", True)])
def test_smoothing_leaves_the_float_model_unchanged(tmp_path, monkeypatch, arch, dtype, tied):
    """Smoothing factors are powers of two, so x / s and W * s are exact in float32 and bfloat16
    and every product x_j W_ij keeps its bits: the smoothed float model's logits must equal the
    unsmoothed ones exactly (tolerance 0), while the folded weights did change. A tied LM head /
    embedding (SmolLM2) is left as it was."""
    from pagedllm.models.smoothquant import apply_smoothquant, calibration_token_ids
    from pagedllm.models.checkpoint import load_tokenizer

    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_LINEAR", "0")  # keep the plain float weights to fold into
    path = build_checkpoint(str(tmp_path), arch, seed=4, tie_word_embeddings=tied)
    model = _load(path, dtype=dtype)
    embedding = model.embed_tokens.weight.detach().clone()
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    tok = load_tokenizer(path)
    seqs = calibration_token_ids(tok, model.config.vocab_size)
    assert len(seqs) >= 8 and all(len(s) > 20 for s in seqs)  # the texts and the chat turns
    before = _logits(model, seqs[:3] + seqs[-2:])
    layer = model.layers[0]
    attn = layer.self_attn
    v_rows = slice(attn.qkv_proj.q_size + attn.qkv_proj.kv_size, None)
    inter = layer.mlp.gate_up_proj.output_sizes[0]
    folded = lambda: [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,  # noqa: E731
                      attn.qkv_proj.weight[v_rows], layer.mlp.gate_up_proj.weight[inter:], attn.o_proj.weight,
                      layer.mlp.down_proj.weight]
    old = [t.detach().clone() for t in folded()]
    report = apply_smoothquant(model, tok, 0.5)
    assert report.num_smoothed == 4 * 2 and report.num_tokens == sum(len(s) for s in seqs)
    for a, b in zip(old, folded()):
        assert not torch.equal(a, b)  # all four folds happened
    assert torch.equal(_logits(model, seqs[:3] + seqs[-2:]), before)
    assert torch.equal(model.embed_tokens.weight, embedding)


def _outlier_checkpoint(out_dir: str, factor: float = 40.0) -> str:
    """A tiny Llama whose linear inputs have outlier channels (as real LLMs do), with the same float
    function as the plain one: channels of each RMSNorm weight, of the up_proj rows and of the
    v_proj rows are multiplied by ``factor``, and the matching columns of the consumers divided."""
    import transformers

    build_checkpoint(out_dir, "llama", seed=9)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for norm, consumers, ch in ((layer.input_layernorm, (a.q_proj, a.k_proj, a.v_proj), [3, 41]),
                                        (layer.post_attention_layernorm, (m.gate_proj, m.up_proj), [17, 50])):
                norm.weight[ch] *= factor
                for c in consumers:
                    c.weight[:, ch] /= factor
            m.up_proj.weight[[7, 90]] *= factor
            m.down_proj.weight[:, [7, 90]] /= factor
            a.v_proj.weight[[5, 20]] *= factor  # KV head 0, channel 5 and KV head 1, channel 4
            hd = a.head_dim
            for h in range(model.config.num_attention_heads):  # the query heads reading those KV heads
                kv = h // (model.config.num_attention_heads // model.config.num_key_value_heads)
                for r in (5, 20):
                    if r // hd == kv:
                        a.o_proj.weight[:, h * hd + r % hd] /= factor
    model.save_pretrained(out_dir)
    return out_dir


def test_smoothquant_cures_outlier_channels(tmp_path, monkeypatch):
    """Per-token int8 on a model with outlier channels: without smoothing the logits' error grows
    several-fold over the plain model's; with SmoothQuant it falls back near the plain model's
    (measured: plain 0.039, outliers 0.43, smoothed 0.059 of the mean |logit|; the smoothed
    weights now carry part of the outliers, hence a little above the plain model)."""
    from pagedllm.models.checkpoint import load_tokenizer

    plain = build_checkpoint(str(tmp_path / "plain"), "llama", seed=9)
    outlier = _outlier_checkpoint(str(tmp_path / "outlier"))
    tok = load_tokenizer(plain)
    seqs = [list(range(3, 60)), tok.encode("the king and the queen were in the world for a long time.")]
    ref = _logits(_load(plain), seqs).double()
    assert (_logits(_load(outlier), seqs).double() - ref).abs().max() < 1e-3  # same float function

    def err(path: str) -> float:  # mean |logit error| / mean |logit|
        return float((_logits(_load(path, "int8"), seqs).double() - ref).abs().mean() / ref.abs().mean())

    monkeypatch.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", "0")
    plain_err, outlier_err = err(plain), err(outlier)
    monkeypatch.delenv("PAGEDLLM_SMOOTHQUANT_ALPHA")
    smooth_err = err(outlier)
    print(f"int8 relative logit error: plain {plain_err:.4f}, outliers {outlier_err:.4f}, smoothed {smooth_err:.4f}")
    assert outlier_err > 4 * plain_err  # the injected outliers hurt per-token int8
    assert smooth_err < 0.2 * outlier_err and smooth_err < 2 * plain_err  # and smoothing cures them
    assert smooth_err > 0  # still quantized


def test_smoothquant_alpha_env(monkeypatch):
    from pagedllm.layers.quantization.smoothquant import smoothquant_alpha

    assert smoothquant_alpha(0.5) == 0.5 and smoothquant_alpha(None) is None
    monkeypatch.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", "0")
    assert smoothquant_alpha(0.5) is None
    monkeypatch.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", "0.7")
    assert smoothquant_alpha(0.5) == 0.7 and smoothquant_alpha(None) == 0.7
    monkeypatch.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", "1.5")
    with pytest.raises(ValueError, match="PAGEDLLM_SMOOTHQUANT_ALPHA"):
        smoothquant_alpha(0.5)


@pytest.mark.parametrize("quant_types", [("Q8_0",), None])
def test_gguf_q8_0_straight_into_int8(tmp_path, monkeypatch, quant_types):
    """``--quantization int8`` without SmoothQuant on a GGUF file: Q8_0 matrices become the int8
    layers' weights straight from their blocks (``q8_0_to_int8_per_channel``, per tensor: fused
    q/k/v and gate/up rows are per-row conversions), and the model equals the one loaded through
    dequantized float weights bit for bit (the block values are exact in float32, and both
    requantize per channel with the same scales). ``None``: the mixed-type file of test_gguf
    (F32 .. Q5_1 in turn): fused layers with rows of several types fall back to float rows."""
    pytest.importorskip("gguf")
    from pagedllm.models import loader
    from pagedllm.models.gguf import Q8_0Weight, iterate_gguf_weights, load_gguf_config
    from test_gguf import write_llama_gguf

    hf = build_checkpoint(str(tmp_path / "hf"), "llama", seed=5)
    path = str(tmp_path / "tiny.gguf")
    types = write_llama_gguf(hf, path, **({"quant_types": quant_types} if quant_types else {}))
    monkeypatch.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", "0")
    assert loader.gguf_q8_0_direct(get_quantization_config("int8"))
    from pagedllm.layers.quantization import q8_0

    finished, finish = [], q8_0.finish_q8_0

    def spy(layer, to_int8):
        finished.append(finish(layer, to_int8))
        return finished[-1]

    monkeypatch.setattr(q8_0, "finish_q8_0", spy)
    direct = _load(path, "int8")
    assert finished.count(True) == (7 if quant_types else 1) and finished.count(False) >= 1  # int8 / float rows
    raw = {n: w for n, w in iterate_gguf_weights(path, load_gguf_config(path), raw_q8_0=True)
           if isinstance(w, Q8_0Weight)}
    assert len(raw) == sum(t == "Q8_0" for t in types.values()) >= 2
    checked = 0
    for i, layer in enumerate(direct.layers):
        parts = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
                 "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}
        for fused, names in parts.items():
            blocks = [raw.get(f"model.layers.{i}.{fused.split('.')[0]}.{n}.weight") for n in names]
            if any(b is None for b in blocks):
                continue  # some rows of another type: loaded through float rows
            q, scale = zip(*(q8_0_to_int8_per_channel(b.qweight, b.scales) for b in blocks))
            mod = layer.get_submodule(fused)
            assert torch.equal(int8.weight_matrix(mod).t(), torch.cat(q)) and torch.equal(mod.weight_scale, torch.cat(scale))
            assert not hasattr(mod, "weight") and not hasattr(mod, "q8_0_qs")
            checked += 1
    assert checked == (7 if quant_types else 1)  # all but layer 0's qkv, whose q and k test_gguf pins to F32
    monkeypatch.setattr(loader, "gguf_q8_0_direct", lambda cfg: False)
    via_float = _load(path, "int8")
    seqs = [list(range(3, 40)), [5, 9, 200, 7]]
    assert torch.equal(_logits(direct, seqs), _logits(via_float, seqs))


# ---- engine --------------------------------------------------------------------------------------
def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


GREEDY_TOP2 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
NEAR_TIE = 0.05  # top-2 logprob margin below which float noise may pick the other token
LOGPROB_TOL = 0.03


def assert_same_greedy(ref, got) -> None:
    """Greedy outputs agree token for token, with logprobs within LOGPROB_TOL, up to the first
    position where ``ref``'s two best tokens were a near-tie (margin < NEAR_TIE); after a near-tie
    the runs may part.

    Why not exact: the int8 matmuls are exact and their per-token scales batch invariant, but the
    float attention of a chunked prefill sums in another order than the whole prompt's (fp32
    logprobs differ by ~1e-6 here), and one int8 rounding flipped by that moves a logprob of this
    tiny random model by up to ~0.02, while its top-2 margins are often below 0.03 (measured). A
    scale that depended on the batch would move every logprob by the int8 error itself (tested:
    one activation scale per step instead of per token fails this check)."""
    for a, b in zip(ref, got):
        ca, cb = a.outputs[0], b.outputs[0]
        for pos, (ta, tb) in enumerate(zip(ca.token_ids, cb.token_ids)):
            top = sorted((lp.logprob for lp in ca.logprobs[pos].values()), reverse=True)
            if ta != tb:
                assert top[0] - top[1] < NEAR_TIE, (pos, ca.token_ids, cb.token_ids)
                break
            assert abs(ca.logprobs[pos][ta].logprob - cb.logprobs[pos][tb].logprob) < LOGPROB_TOL, pos
            if top[0] - top[1] < NEAR_TIE:
                break  # later tokens follow a near-tie: either continuation is right
        assert len(cb.token_ids) == len(ca.token_ids)


def test_int8_model_batch_invariant_with_chunking_preemption_prefix_caching(llama_dir):
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompts = make_prompts(vocab, [1, 5, 17, 40, 96, 150, 231], seed=5)
    prompts.append(prompts[5][:100] + [7, 8, 9])  # shares a cached prefix with another prompt
    alone_llm = LLM(llama_dir, quantization="int8", kv_cache_memory=4 << 20, enable_prefix_caching=False)
    model = alone_llm.llm_engine.executor.runner.model
    assert model.quantization_report.num_quantized == 2 * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
    assert model.layers[0].mlp.gate_up_proj.weight_q.dtype == torch.int8
    alone = [alone_llm.generate([p], GREEDY_TOP2, use_tqdm=False)[0] for p in prompts]
    assert_pool_empty(alone_llm)
    del alone_llm

    # 17 blocks of 16 tokens (one 272-token sequence), steps of <= 48 tokens: chunked prefills and
    # preemptions; then a second round that hits the prefix cache.
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(llama_dir, quantization="int8", kv_cache_memory=17 * bytes_per_block, max_model_len=272,
              max_num_batched_tokens=48)
    assert_same_greedy(alone, llm.generate(prompts, GREEDY_TOP2, use_tqdm=False))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_same_greedy(alone[::-1], llm.generate(prompts[::-1], GREEDY_TOP2, use_tqdm=False))
    assert_pool_empty(llm)
    # The prompts of one chunk (<= 48 tokens: no float reordering) agree exactly, near-ties or not.
    short = llm.generate(prompts[:4], GREEDY_TOP2, use_tqdm=False)
    assert _ids(short) == _ids(alone[:4])
    assert_pool_empty(llm)


@pytest.mark.parametrize("quantization", ["int8", "int8-g64"])
def test_int8_close_to_float(llama_dir, quantization):
    """Int8 logprobs of the prompt tokens stay near the float ones (tiny random model, logprobs
    around -7: a loose sanity bound, mean error < 1 % of the mean |logprob|; the quality figures
    of real models are in benchmarks/README.md)."""
    vocab = transformers.AutoConfig.from_pretrained(llama_dir).vocab_size
    prompt = make_prompts(vocab, [60], seed=3)[0]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    f = LLM(llama_dir, kv_cache_memory=1 << 20).generate([prompt], sp, use_tqdm=False)[0]
    llm = LLM(llama_dir, kv_cache_memory=1 << 20, quantization=quantization)
    q = llm.generate([prompt], sp, use_tqdm=False)[0]
    pairs = [(a[t].logprob, b[t].logprob) for t, a, b in zip(prompt[1:], f.prompt_logprobs[1:], q.prompt_logprobs[1:])]
    diffs = [abs(a - b) for a, b in pairs]
    assert 0 < sum(diffs) / len(diffs) < 0.01 * sum(abs(a) for a, _ in pairs) / len(pairs)
    assert max(diffs) < 0.25
    assert_pool_empty(llm)


@pytest.mark.parametrize("arch,extra", [("qwen2", {}), ("llama", {"num_key_value_heads": 1})])
def test_tp2_int8_matches_tp1_int8(tmp_path, arch, extra):
    """With SmoothQuant (the default): both ranks compute TP=1's factors (column maxima and the
    o_proj groups over ranks; qwen2: q/k/v biases; one KV head: replicated on both ranks)."""
    from test_tensor_parallel import assert_tp2_matches_tp1, make_prompts as tp_prompts

    d = build_checkpoint(str(tmp_path), arch, seed=7, **extra)
    assert_tp2_matches_tp1(d, tp_prompts(500, seed=2), quantization="int8", max_num_batched_tokens=64)


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pp_int8_matches_one_process(llama_dir, tp, pp):
    """Pipeline stages calibrate SmoothQuant together (hidden states passed on as in a step), so
    PP = 2 and TP = 2 x PP = 2 give the single process's int8 outputs; the TP collectives of
    the int8 layers and of the smoothing stay within a stage's TP group."""
    from test_pipeline_parallel import BLOCK_BYTES_PER_LAYER_HEAD, BLOCKS
    from test_tensor_parallel import assert_same_outputs, make_prompts as tp_prompts, run

    def make(tp_size: int, pp_size: int) -> LLM:
        kv = BLOCKS * BLOCK_BYTES_PER_LAYER_HEAD * (2 // pp_size) * (2 // tp_size)
        return LLM(llama_dir, quantization="int8", tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size,
                   max_model_len=128, kv_cache_memory=kv, max_num_batched_tokens=64)

    prompts = tp_prompts(500)
    one = make(1, 1)
    smoothing = one.llm_engine.executor.runner.model.quantization_report.smoothing
    assert smoothing.startswith("SmoothQuant alpha=0.65 on 8 linear inputs")
    ref = run(one, prompts)
    del one
    llm = make(tp, pp)
    try:
        stage0 = llm.llm_engine.executor.driver.runner.model.quantization_report.smoothing
        assert stage0.startswith("SmoothQuant alpha=0.65 on 4 linear inputs")  # layer 0 of 2
        assert_same_outputs(ref, run(llm, prompts))
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tp2_int8_matches_tp1_int8_gguf_q8_0_direct(tmp_path, monkeypatch):
    """Q8_0 blocks straight into int8 under TP=2: the row-parallel layers' per-channel scales take
    the max over ranks, so TP=2 equals TP=1."""
    pytest.importorskip("gguf")
    from test_gguf import write_llama_gguf
    from test_tensor_parallel import assert_tp2_matches_tp1, make_prompts as tp_prompts

    hf = build_checkpoint(str(tmp_path / "hf"), "llama", seed=6)
    path = str(tmp_path / "q8.gguf")
    write_llama_gguf(hf, path, quant_types=("Q8_0",))
    monkeypatch.setenv("PAGEDLLM_SMOOTHQUANT_ALPHA", "0")  # the direct path; workers inherit it
    assert_tp2_matches_tp1(path, tp_prompts(500, seed=3), quantization="int8", max_num_batched_tokens=64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_on_cuda(dtype):
    """On CUDA ``_int_mm`` needs m > 16 and k, n multiples of 8 (padded / fallen back here)."""
    for m, k, n in [(1, 64, 48), (16, 576, 960), (17, 576, 960), (5, 100, 30), (33, 96, 4096)]:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        from pagedllm.layers.quantization.int8 import int8_weight_layout

        assert torch.equal(int8_mm(a, int8_weight_layout(w)).cpu(), (a.cpu().long() @ w.cpu().long().t()).int())
    with torch.device("cuda"):
        layer = make_linear(ColumnParallelLinear, 576, 960, dtype=dtype)
    w = torch.randn(960, 576, device="cuda") * 0.05
    layer.weight_loader(layer.weight, w)
    process_weights_after_loading(layer, layer.cfg)
    x = torch.randn(48, 576, device="cuda", dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    bound = int8_error_bound(x.float(), w, w.abs().amax(1) / 127, 64)
    rounding = (x.double() @ w.double().t()).abs() * (2 ** -7 if dtype == torch.bfloat16 else 0)
    assert ((y.double() - x.double() @ w.double().t()).abs() <= bound + rounding).all()
