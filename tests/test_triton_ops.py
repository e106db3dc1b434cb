"""The CUDA wing's Triton kernels for the elementwise ops (pagedllm/platforms/cuda/triton_ops.py) equal the
seam's native torch bodies (platforms/ops.py ``<op>_native``): float32 within 1e-5 relative (the sum of squares
in another order, another exp), bfloat16 and float16 within one step of the dtype and mostly bit for bit (the
kernels round where the native ops do); RoPE and the residual add bit for bit. And the seam bound to ``CudaOps``
takes them for a layer's tensors, while CPU tensors off the interpreter keep the CPU kernels.

Where torch sees a GPU the kernels run compiled on CUDA tensors; elsewhere Triton's interpreter runs them on CPU
tensors. The interpreter must be chosen before triton itself is imported (``triton.language``'s own functions,
``tl.sum`` among them, are ``@triton.jit`` functions decorated then), so on a host without a GPU this module sets
``TRITON_INTERPRET=1`` at collection when triton is not imported yet (for the rest of the session: triton's
kernels cannot run there otherwise). Where something imported it first (transformers does, through torch's
triton helpers), the tests run in a fresh process instead (``test_in_a_fresh_process``), and skip here.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's import: see the module docstring
pytest.importorskip("triton", reason="triton is not installed (the [test] / [cuda] extras)")

from pagedllm.layers.activation import silu_and_mul  # noqa: E402
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from pagedllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from pagedllm.platforms import cuda as cuda_wing  # noqa: E402
from pagedllm.platforms import ops  # noqa: E402
from pagedllm.platforms.cpu.ops import CpuOps  # noqa: E402
from pagedllm.platforms.cuda import ops as cuda_ops  # noqa: E402
from pagedllm.platforms.cuda import triton_ops  # noqa: E402
from pagedllm.platforms.cuda.ops import CudaOps  # noqa: E402
from pagedllm.platforms.interface import PlatformOps  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEP = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # rtol: 1e-5, or one step
EPS = 1e-6
# the interpreter's numpy warns where exp(-g) overflows to inf (g < -88: silu(g) = g / inf = -0, as on a GPU)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


IN_PROCESS = DEVICE == "cuda" or triton_ops.INTERPRET  # else triton came first: see the module docstring
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tk():
    """The kernels module: compiled on a GPU host, interpreted elsewhere."""
    if not IN_PROCESS:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run by test_in_a_fresh_process")
    return triton_ops


def test_in_a_fresh_process():
    """This file's tests in a process that sets the interpreter before triton's import, where this one
    imported triton first: they all pass, none skipped."""
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and summary.count("skipped") <= 1, tail  # (this one)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, equal_share: float = 0.95,
          steps: int = 1, atol: float = 0.0) -> None:
    """Within ``steps`` of the dtype's tolerance (and a small absolute one for values near 0, at
    least ``atol``); in 16-bit dtypes also mostly the native bits."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=steps * STEP[dtype],
                               atol=max(atol, 1e-6 if dtype == torch.float32 else 1e-5))
    if dtype != torch.float32:
        assert (got == want).float().mean().item() >= equal_share


def rand(*shape, dtype, scale=1.0, seed=0, device=DEVICE):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


# ---------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", [(1, 64), (7, 96), (64, 576)])
def test_rms_norm_and_fused_add(tk, dtype, n, hidden):
    wide = rand(n, hidden + 32, dtype=dtype, scale=3, seed=n)
    x = wide[:, 16:16 + hidden]  # rows strided (a slice of a wider projection)
    w = rand(hidden, dtype=dtype, seed=1)
    close(tk.rms_norm(x, w, EPS), ops.rms_norm_native(x, w, EPS), dtype)
    res = rand(n, hidden, dtype=dtype, seed=2)
    r_got, r_want = res.clone(), res.clone()
    got = tk.rms_norm(x, w, EPS, r_got)
    want, _ = ops.fused_add_rms_norm_native(x, r_want, w, EPS)
    assert torch.equal(r_got, r_want)  # the residual add: one rounding in the dtype, as torch's add_
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_heads_in_place(tk, dtype, head_dim):
    """Qwen3's / Gemma 3's q/k norms on a view of the qkv projection (token and head strides free)."""
    qkv = rand(7, 6, head_dim, dtype=dtype, scale=2, seed=head_dim)
    w = rand(head_dim, dtype=dtype, seed=3) * 0.5
    for gemma, native in ((False, ops.rms_norm_native), (True, ops.gemma_rms_norm_native)):
        got = qkv.clone()
        want = native(got[:, 1:4], w, EPS)
        assert tk.rms_norm_heads_(got[:, 1:4], w, EPS, gemma)
        close(got[:, 1:4], want, dtype)
        assert torch.equal(got[:, :1], qkv[:, :1]) and torch.equal(got[:, 4:], qkv[:, 4:])  # other heads untouched
        if not gemma:  # the out-of-place norm of such a view (what the seam runs where no in-place kernel applies)
            close(tk.rms_norm(qkv[:, 1:4], w, EPS), ops.rms_norm_native(qkv[:, 1:4], w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", [(1, 64), (7, 576)])
def test_gemma_norms(tk, dtype, n, hidden):
    x = rand(n, hidden, dtype=dtype, scale=3, seed=n)
    w, w2 = rand(hidden, dtype=dtype, seed=4) * 0.2, rand(hidden, dtype=dtype, seed=5) * 0.2
    close(tk.gemma_rms_norm(x, w, EPS), ops.gemma_rms_norm_native(x, w, EPS), dtype)
    res = rand(n, hidden, dtype=dtype, seed=6)
    for next_weight in (None, w2):
        r_got, r_want = res.clone(), res.clone()
        got = tk.gemma_add_rms_norm_(r_got, x, w, EPS, next_weight, 1e-5)
        r_want.add_(ops.gemma_rms_norm_native(x, w, EPS))
        close(r_got, r_want, dtype, equal_share=0.9)  # (an fp32 difference in the norm can flip the add's rounding)
        if next_weight is None:
            assert got is r_got
        else:
            close(got, ops.gemma_rms_norm_native(r_got, w2, 1e-5), dtype)


# ---------------------------------------------------------------------------------- activations
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 64), (7, 96), (64, 576)])
def test_silu_and_gelu_tanh_and_mul(tk, dtype, n, inter):
    """16-bit: within two steps (an activation one step off, then the product's own rounding)."""
    x = rand(n, 2 * inter, dtype=dtype, scale=3, seed=inter)
    before = x.clone()
    close(tk.silu_and_mul(x), ops.silu_and_mul_native(x.clone()), dtype, steps=2)
    # GELU: the native 0.5 g (1 + tanh(u)) loses bits to cancellation where g << 0 (1 + tanh is off by up
    # to 2^-24 absolute: 0.5 |g| |up| 2^-24 in the product), the kernel's g * sigmoid(2u) does not; the 16-bit
    # roundings of such tails differ more often
    atol = 2.0 ** -24 * x.float().abs().max().item() ** 2
    close(tk.gelu_tanh_and_mul(x), ops.gelu_tanh_and_mul_native(x), dtype, equal_share=0.85, steps=2, atol=atol)
    assert torch.equal(x, before)  # the kernels leave x as it is
    strided = torch.cat([x, x[:, :8]], dim=1)[:, :2 * inter]
    assert torch.equal(tk.silu_and_mul(strided), tk.silu_and_mul(x))
    batched = x.view(1, n, 2 * inter)  # [..., 2I]: leading dims kept
    assert tk.silu_and_mul(batched).shape == (1, n, inter)


# ----------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (128, 96), (96, 32)])
def test_rotary_in_place(tk, dtype, head_dim, rotary_dim):
    """The neox (rotate-half) layout of ``RotaryEmbedding``, the table its ``cos_sin`` gathers, a
    partial rotary's x[..., :R] view; q as heads of a qkv projection's view: bit for bit."""
    rope = RotaryEmbedding(head_dim, 256, {"rope_theta": 10000.0}, dtype, rotary_dim=rotary_dim).to(DEVICE)
    for n in (1, 7, 64):
        cs = rope.cos_sin(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE))
        qkv = rand(n, 5, head_dim, dtype=dtype, scale=2, seed=n)
        got, want = qkv.clone(), qkv.clone()
        assert tk.rotary_(got[:, :3, :rotary_dim], cs)
        ops.rotary_native_(want[:, :3, :rotary_dim], cs)
        assert torch.equal(got, want), n


# ------------------------------------------------------------------------------- where none applies
def test_kernels_decline_what_they_do_not_take(tk):
    x, w = rand(3, 64, dtype=torch.bfloat16), rand(64, dtype=torch.float32)
    assert tk.rms_norm(x, w, EPS) is None  # mixed dtypes (native: promotion)
    assert tk.rms_norm(x.double(), w.double(), EPS) is None
    assert tk.rms_norm(x.t(), rand(3, dtype=torch.bfloat16), EPS) is None  # last dim not contiguous
    assert tk.silu_and_mul(rand(3, 63, dtype=torch.float32)) is None  # odd
    wide = rand(1, tk.MAX_HIDDEN + 2, dtype=torch.float32)
    assert tk.rms_norm(wide, wide[0], EPS) is None  # a row wider than one block
    heads = rand(2, 3, 16, dtype=torch.float32)
    before = heads.clone()
    assert not tk.rms_norm_heads_(heads, rand(16, dtype=torch.bfloat16), EPS)
    cs = torch.zeros(2, 2, 1, 16, dtype=torch.bfloat16)
    assert not tk.rotary_(heads, cs) and torch.equal(heads, before)  # a table in another dtype


# ---------------------------------------------------------------------------------------- the seam
class Recorder:
    """Stands in for the kernels module: forwards each call and records its name."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.module, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_through_cuda_ops_equal_native(tk, dtype, monkeypatch):
    """The seam bound to ``CudaOps`` (with the interpreted kernels as its CPU tensors' kernels on a
    host without a GPU): the layers (RMSNorm with and without the residual, the q/k norm, Gemma's
    post-norm add, SiLU * up, partial RoPE) reach the Triton kernels and give the native results."""
    rec = Recorder(tk)
    monkeypatch.setattr(cuda_ops, "_KERNELS" if DEVICE == "cuda" else "_CPU_KERNELS", rec)
    g = torch.Generator().manual_seed(7)
    x, res = rand(7, 96, dtype=dtype, scale=3, seed=7), rand(7, 96, dtype=dtype, seed=8)
    norm, qnorm, gnorm, gnext = RMSNorm(96, 1e-5, dtype), RMSNorm(32, 1e-5, dtype), GemmaRMSNorm(96, EPS, dtype), \
        GemmaRMSNorm(96, EPS, dtype)
    for m in (norm, qnorm, gnorm, gnext):
        m.to(DEVICE).weight.data.copy_(torch.randn(m.weight.shape[0], generator=g).to(DEVICE, dtype) * 0.2)
    rope = RotaryEmbedding(32, 64, {"rope_theta": 10000.0}, dtype, rotary_dim=16).to(DEVICE)
    positions = torch.arange(7, device=DEVICE)
    qkv, gate_up = rand(7, 6, 32, dtype=dtype, seed=9), rand(7, 2 * 96, dtype=dtype, seed=10)

    def run():
        r1, r2 = res.clone(), res.clone()
        added, r1 = norm(x, r1)
        q, k = rope(positions, qkv[:, :4], qkv[:, 4:])
        return dict(norm=norm(x), added=added, residual=r1, heads=qnorm.forward_heads_(qkv.clone()[:, 1:3]).clone(),
                    gemma_add=gnorm.add_to_(r2, x, gnext), gemma_residual=r2, silu=silu_and_mul(gate_up.clone()),
                    q=q, k=k)

    monkeypatch.setattr(ops, "_OPS", CudaOps)
    fast = run()
    assert set(rec.calls) == {"rms_norm", "rms_norm_heads_", "gemma_add_rms_norm_", "silu_and_mul", "rotary_"}
    monkeypatch.setattr(ops, "_OPS", PlatformOps)
    slow = run()
    for name in ("residual", "q", "k"):
        assert torch.equal(fast[name], slow[name]), name
    for name, want in slow.items():
        close(fast[name], want, dtype, equal_share=0.9)


def test_cpu_tensors_keep_the_cpu_kernels_without_the_interpreter(tk, monkeypatch):
    """Off the interpreter (``_CPU_KERNELS`` None: any real run), ``CudaOps`` gives a CPU tensor
    ``CpuOps``' results, bit for bit, and calls no Triton kernel."""
    rec = Recorder(tk)
    monkeypatch.setattr(cuda_ops, "_CPU_KERNELS", None)
    monkeypatch.setattr(cuda_ops, "_KERNELS", rec)
    x, w, res = (rand(*shape, dtype=torch.float32, seed=i, device="cpu")
                 for i, shape in enumerate([(5, 64), (64,), (5, 64)]))
    for a, b in ((CudaOps.rms_norm(x, w, EPS), CpuOps.rms_norm(x, w, EPS)),
                 (CudaOps.rms_norm(x, w, EPS, res.clone()), CpuOps.rms_norm(x, w, EPS, res.clone())),
                 (CudaOps.silu_and_mul(x), CpuOps.silu_and_mul(x))):
        assert (a is None and b is None) or torch.equal(a, b)
    assert rec.calls == []


def test_no_triton_means_native_bodies(monkeypatch):
    """Where triton_ops does not import, ``_kernels()`` answers None (CUDA tensors: the native bodies)."""
    monkeypatch.setattr(cuda_ops, "_KERNELS", cuda_ops._UNRESOLVED)
    monkeypatch.setattr(cuda_ops, "_CPU_KERNELS", None)
    monkeypatch.setitem(sys.modules, "pagedllm.platforms.cuda.triton_ops", None)  # import -> ImportError
    monkeypatch.delattr(cuda_wing, "triton_ops", raising=False)
    assert cuda_ops._kernels() is None and cuda_ops._KERNELS is None and cuda_ops._CPU_KERNELS is None
