"""The GEMM over GGUF blocks (platforms/cpu/gguf_gemm.cpp) against ``gguf.quants.dequantize`` and a
float64 matmul, on random blocks: ``gguf.quants.quantize`` of random floats where the package
quantizes the type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and random bytes with small finite fp16 scales
for every type (all bit patterns of the values, 6-bit scales and high bits; Q8_0's -128 too).

Tolerance: the kernel quantizes each block of 32 activations to int8 with d = max|x| / 127, so
each x is off by at most d / 2, and a dot by at most sum_b (d_b / 2) * sum_{k in b} |w_k|; plus
float32 rounding of the sums, bounded by 1e-5 * sum |w| |x| (each of the K / 32 block sums is
exact in int32 and rounded once to float32, then summed in 8 lanes).
"""
import numpy as np
import pytest
import torch

from pagedllm.platforms.cpu import gguf_gemm
from pagedllm.platforms.cpu.build import BASE_FLAGS

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

# type -> byte offsets of its fp16 scale fields
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}
_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, k / block * bytes]: random bytes, each fp16 scale field set to a random small value."""
    _, elems, nbytes = gguf_gemm.TYPES[gguf_gemm.TYPE_IDS[name]]
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in _HALVES[name]:
        raw[:, :, off:off + 2] = rng.uniform(-0.02, 0.02, size=(n, k // elems)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def quantized_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return quants.quantize(w, getattr(gguf.GGMLQuantizationType, name))


def check(lib, name: str, raw: np.ndarray, x: torch.Tensor) -> None:
    tid = gguf_gemm.TYPE_IDS[name]
    blk = gguf_gemm.act_block(tid)  # 32, or 256 for the K-quants (llama.cpp's Q8_K)
    w = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).astype(np.float64)  # [n, k]
    act = gguf_gemm.quantize_rows(x, lib, blk)
    out = torch.full((x.shape[0], raw.shape[0]), float("nan"))
    gguf_gemm.gemm(tid, act, raw, out, lib)
    xd = x.double().numpy()
    ref = xd @ w.T
    m, k = xd.shape
    d = np.abs(xd).reshape(m, -1, blk).max(axis=2) / 127  # [m, k / blk]
    wabs = np.abs(w).reshape(w.shape[0], -1, blk).sum(axis=2)  # [n, k / blk]
    tol = (d / 2) @ wabs.T * (1 + 1e-5) + 1e-5 * np.abs(xd) @ np.abs(w).T + 1e-6
    err = np.abs(out.double().numpy() - ref)
    assert np.all(np.isfinite(out.numpy())), name
    assert np.all(err <= tol), f"{name}: max err {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"
    # the activation values quantized as described (within d / 2 of x)
    deq = act.q.double().reshape(m, -1, blk) * act.d.double()[:, :, None]
    assert np.all(np.abs(deq.reshape(m, k).numpy() - xd) <= d.repeat(blk, axis=1) * 0.5 * (1 + 1e-5) + 1e-12)
    if blk == 32:
        torch.testing.assert_close(act.s.double(), act.d.double() * act.q.reshape(m, -1, 32).sum(-1).double(),
                                   rtol=1e-6, atol=1e-9)
    else:
        assert torch.equal(act.s, act.q.reshape(m, -1, 16).sum(-1, dtype=torch.int16))


def _libs():
    ok, why = gguf_gemm.available()
    if not ok:
        pytest.skip(why)
    libs = [("native", gguf_gemm._LIBRARY.get()[0])]
    # the AVX2-only path (maddubs, no VNNI, no AVX-512), as a host without them compiles it
    libs.append(("avx2", gguf_gemm.build_with(BASE_FLAGS + ["-mno-avx512f", "-mno-avxvnni", "-mno-avx512vnni"])))
    return libs


@pytest.fixture(scope="module")
def libs():
    return _libs()


@pytest.mark.parametrize("name", sorted(gguf_gemm.TYPE_IDS))
@pytest.mark.parametrize("m", [1, 3, 7])  # 7: a full row tile of 4 and a partial one (Q4_K, Q5_K: panels)
def test_random_bytes(libs, name, m):
    rng = np.random.default_rng(hash((name, m)) % 2**32)
    k = 512
    n = 37  # not a multiple of the 16-row chunks nor of the threads
    raw = random_blocks(name, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[0, :32] *= 50  # blocks of very different scales
    for _, lib in libs:
        check(lib, name, raw, x)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m,n,k", [(8, 37, 256), (13, 70, 768), (48, 130, 512)])
def test_k_quant_panels(libs, name, m, n, k):
    """The K-quants' many-row GEMM (gguf_panel.h, from 4 rows, Q6_K 8): at Q6_K's threshold and
    above, N not a multiple of its 64-column panels nor of the threads' shares, K of one and several
    super-blocks."""
    rng = np.random.default_rng(m * 1000 + n)
    raw = random_blocks(name, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[0, :32] *= 50
    x[-1, -256:] *= 0.01
    for _, lib in libs:
        check(lib, name, raw, x)


@pytest.mark.parametrize("name", _QUANTIZABLE)
def test_quantized_by_gguf(libs, name):
    rng = np.random.default_rng(7)
    raw = quantized_blocks(name, 64, 256, rng)
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    for _, lib in libs:
        check(lib, name, raw, x)


def test_strided_out_and_bf16(libs):
    """A column slice of a wider output (a fused layer's part) and bf16 rows."""
    rng = np.random.default_rng(3)
    raw = random_blocks("Q4_K", 20, 256, rng)
    x = torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32)).bfloat16()
    wide = torch.zeros(2, 50)
    act = gguf_gemm.quantize_rows(x, block=256)
    gguf_gemm.gemm(gguf_gemm.TYPE_IDS["Q4_K"], act, raw, wide[:, 10:30])
    full = torch.empty(2, 20)
    gguf_gemm.gemm(gguf_gemm.TYPE_IDS["Q4_K"], gguf_gemm.quantize_rows(x.float(), block=256), raw, full)
    assert torch.equal(wide[:, 10:30], full)
    assert not wide[:, :10].any() and not wide[:, 30:].any()


def test_bad_shapes(libs):
    raw = random_blocks("Q8_0", 4, 64, np.random.default_rng(0))
    act = gguf_gemm.quantize_rows(torch.randn(1, 96))
    with pytest.raises(ValueError, match="does not fit"):
        gguf_gemm.gemm(gguf_gemm.TYPE_IDS["Q8_0"], act, raw, torch.empty(1, 4))
    with pytest.raises(ValueError, match="no kernel"):
        gguf_gemm.gemm(99, act, raw, torch.empty(1, 4))
    k_raw = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="blocks of 256, not 32"):
        gguf_gemm.gemm(gguf_gemm.TYPE_IDS["Q4_K"], gguf_gemm.quantize_rows(torch.randn(1, 256)), k_raw,
                       torch.empty(1, 4))
    with pytest.raises(ValueError, match="not a multiple of 256"):
        gguf_gemm.quantize_rows(torch.randn(1, 96), block=256)


@pytest.mark.parametrize("m", [1, 5, 9])  # 5: Q4_K on panels, Q6_K on rows; 9: both on panels
def test_linear_segments(libs, m):
    """``linear`` (one C call: quantization and every segment in one parallel region) equals
    ``quantize_rows`` + ``gemm`` per segment, on a fused layer of mixed types (K-quants and a
    32-weight type, so both activation blocks), bit for bit; a second call takes the cached segment
    arguments."""
    rng = np.random.default_rng(11)
    k = 512
    segments, first = [], 0
    for name, rows in (("Q4_K", 24), ("Q6_K", 8), ("Q8_0", 8)):
        segments.append((first, gguf_gemm.TYPE_IDS[name], torch.from_numpy(random_blocks(name, rows, k, rng))))
        first += rows
    x = torch.from_numpy(rng.standard_normal((m, 2 * k)).astype(np.float32))[:, ::2]  # strided: a float copy
    for _, lib in libs:
        want = torch.empty(m, first)
        for f, tid, raw in segments:
            act = gguf_gemm.quantize_rows(x, lib, gguf_gemm.act_block(tid))
            gguf_gemm.gemm(tid, act, raw, want[:, f:f + raw.shape[0]], lib)
        assert torch.equal(gguf_gemm.linear(x, segments, first, lib), want)
        assert torch.equal(gguf_gemm.linear(x, segments, first, lib), want)
    with pytest.raises(ValueError, match="outside"):
        gguf_gemm.linear(x, segments, first - 1)
