"""Our own Triton kernels for the seam's elementwise ops on a GPU: residual add + RMSNorm, RMSNorm (per
row or per head, in place), Gemma's RMSNorm (weight + 1) and its post-norm residual add, rotate-half RoPE
in place, and SiLU(gate) * up / GELU-tanh(gate) * up. Each is one pass over memory where the native
torch bodies (``platforms/ops.py``'s ``<op>_native``) launch 2-6 kernels.

Called by ``platforms/cuda/ops.py`` (``CudaOps``) for CUDA tensors. The functions here do not test the
device: they run wherever Triton runs, which includes CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported: ``triton.jit`` reads it when it decorates;
``INTERPRET`` records what it saw). That is how tests/test_triton_ops.py checks them without a GPU.

Arithmetic: float16, bfloat16 and float32 tensors, loaded into float32, rounded back to the tensor's
dtype at the points where the native body rounds (its ops run in that dtype), so that the results are
the native ones up to float32 differences (the sum of squares in another order, the GPU's exp and
rsqrt, products the compiler may fuse into an FMA): bf16 results mostly equal bit for bit. RoPE and the
pre-norm residual add equal them bit for bit in every dtype (RoPE compiles without FMA fusion).

Each function returns None (the in-place ones: False, nothing touched) where its kernel does not
apply: another dtype, mixed dtypes, a last dim that is not contiguous, a row wider than ``MAX_HIDDEN``;
the seam then runs its native body. Only the neox (rotate-half) RoPE layout exists in pagedllm
(``RotaryEmbedding``), so only that one is here.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)  # what the @triton.jit decorators below saw
MAX_HIDDEN = 16384  # a norm's row (or a rotary head) is one block of registers (wider: the native bodies)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# ---------------------------------------------------------------------------------------- rounding
@triton.jit
def _rnd(v, dtype: tl.constexpr):
    """float32 v rounded to ``dtype`` (round to nearest even), kept in float32: where the native body's
    op in that dtype rounds. bfloat16 by hand on the bits: Triton's interpreter truncates a float32 ->
    bfloat16 cast (triton 3.9), and on a GPU these few integer ops cost nothing in a memory-bound kernel
    (the cast of the result is then exact everywhere). NaN stays NaN."""
    if dtype == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, u.to(tl.float32, bitcast=True))
    elif dtype == tl.float32:
        return v
    else:
        return v.to(dtype).to(tl.float32)


# ---------------------------------------------------------------------------------------- norms
@triton.jit
def _rms_norm_kernel(x_ptr, x_s0, x_s1, res_ptr, r_s0, r_s1, w_ptr, out_ptr, o_s0, o_s1, heads, hidden, eps,
                     HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row (token, head): r = x, or residual <- rnd(residual + x) and r = that;
    out <- rnd(w * rnd(r * rsqrt(mean(r^2) + eps))) (Llama's), or GEMMA: rnd(r * rsqrt(..) * (1 + w))."""
    pid = tl.program_id(0)
    tok = (pid // heads).to(tl.int64)
    head = (pid % heads).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + tok * x_s0 + head * x_s1 + cols, mask=mask, other=0.0)
    dtype = x.dtype
    r = x.to(tl.float32)
    if HAS_RES:
        rp = res_ptr + tok * r_s0 + head * r_s1 + cols
        r = _rnd(tl.load(rp, mask=mask, other=0.0).to(tl.float32) + r, dtype)
        tl.store(rp, r.to(dtype), mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = _rnd(r * inv * (1.0 + w), dtype)
    else:
        y = _rnd(w * _rnd(r * inv, dtype), dtype)
    tl.store(out_ptr + tok * o_s0 + head * o_s1 + cols, y.to(dtype), mask=mask)


@triton.jit
def _gemma_add_norm_kernel(x_ptr, x_s0, w_ptr, eps, res_ptr, r_s0, w2_ptr, eps2, out_ptr, hidden,
                           HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: residual <- rnd(residual + rnd(gnorm(x, w))); HAS_OUT: out <-
    rnd(gnorm(residual, w2)). gnorm(v, w) = v * rsqrt(mean(v^2) + eps) * (1 + w), in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_s0 + cols, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _rnd(xf * inv * (1.0 + w), dtype)
    rp = res_ptr + row * r_s0 + cols
    r = _rnd(tl.load(rp, mask=mask, other=0.0).to(tl.float32) + normed, dtype)
    tl.store(rp, r.to(dtype), mask=mask)
    if HAS_OUT:
        inv2 = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / hidden + eps2)
        w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, _rnd(r * inv2 * (1.0 + w2), dtype).to(dtype), mask=mask)


def _row_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """x in a kernel dtype with a contiguous last dim of at most MAX_HIDDEN, each weight [hidden]
    contiguous in x's dtype and on x's device."""
    hidden = x.shape[-1]
    if x.dtype not in DTYPES or x.stride(-1) != 1 or not 0 < hidden <= MAX_HIDDEN:
        return False
    return all(w.shape == x.shape[-1:] and w.dtype == x.dtype and w.is_contiguous() and w.device == x.device
               for w in weights)


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    """(token stride, head stride, heads) of t [N, hidden] (one "head") or [N, h, D]."""
    return (t.stride(0), 0, 1) if t.dim() == 2 else (t.stride(0), t.stride(1), t.shape[1])


def _launch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                 out: torch.Tensor, gemma: bool) -> None:
    n, hidden = x.shape[0], x.shape[-1]
    x_s0, x_s1, heads = _strides3(x)
    o_s0, o_s1, _ = _strides3(out)
    r_s0, r_s1, _ = _strides3(residual) if residual is not None else (0, 0, 1)
    rows = n * heads
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](x, x_s0, x_s1, x if residual is None else residual, r_s0, r_s1, weight, out,
                              o_s0, o_s1, heads, hidden, float(eps), HAS_RES=residual is not None, GEMMA=gemma,
                              BLOCK=block, num_warps=_num_warps(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``PlatformOps.rms_norm``: x [N, hidden] or [N, h, hidden] (token and head strides free),
    weight [hidden]; with residual (x's shape, strides free) residual <- residual + x in place first.
    Returns weight * rnd(r * rsqrt(mean(r^2) + eps)), a new contiguous tensor of x's shape and dtype
    (r: x or the new residual), or None where the kernel does not apply."""
    if x.dim() not in (2, 3) or not _row_ok(x, weight):
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1 or residual.device != x.device):
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, weight, eps, residual, out, gemma=False)
    return out


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """``PlatformOps.gemma_rms_norm``: x [N, hidden] or [N, h, hidden] -> rnd(x * rsqrt(mean(x^2) +
    eps) * (1 + weight)), all in float32, a new contiguous tensor; None where the kernel does not apply."""
    if x.dim() not in (2, 3) or not _row_ok(x, weight):
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, weight, eps, None, out, gemma=True)
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> bool:
    """``PlatformOps.rms_norm_heads_``: in place, the norm over D of each head of x [N, h, D] (token
    and head strides free, D contiguous; Llama's arithmetic, or Gemma's with ``gemma``). Returns
    False, x untouched, where the kernel does not apply. (Each program reads its whole row before
    it writes it, so the output may be x.)"""
    if x.dim() != 3 or not _row_ok(x, weight):
        return False
    _launch_norm(x, weight, eps, None, x, gemma=gemma)
    return True


def gemma_add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        next_weight: Optional[torch.Tensor] = None, next_eps: float = 0.0) -> Optional[torch.Tensor]:
    """``PlatformOps.gemma_add_rms_norm_``: residual [N, hidden] <- rnd(residual + rnd(gnorm(x,
    weight))) in place (x [N, hidden]; both with strided rows), then gnorm(residual, next_weight) as a
    new tensor, or the residual itself without next_weight; None, nothing touched, where the kernel
    does not apply."""
    weights = (weight,) if next_weight is None else (weight, next_weight)
    if (x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
            or residual.device != x.device or not _row_ok(x, *weights)):
        return None
    n, hidden = x.shape
    out = residual if next_weight is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n:
        block = triton.next_power_of_2(hidden)
        _gemma_add_norm_kernel[(n,)](x, x.stride(0), weight, float(eps), residual, residual.stride(0),
                                     weight if next_weight is None else next_weight, float(next_eps), out, hidden,
                                     HAS_OUT=next_weight is not None, BLOCK=block, num_warps=_num_warps(block))
    return out


# ---------------------------------------------------------------------------------- activations
@triton.jit
def _act_and_mul_kernel(x_ptr, x_s0, out_ptr, inter, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): out[row, c] <- rnd(rnd(act(gate[c])) * up[c]) for x[row] = [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gp = x_ptr + row * x_s0 + cols
    g = tl.load(gp, mask=mask, other=0.0)
    dtype = g.dtype
    gf = g.to(tl.float32)
    up = tl.load(gp + inter, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3): no cancellation at g << 0
        u = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
        a = gf / (1.0 + tl.exp(-2.0 * u))
    else:
        a = gf / (1.0 + tl.exp(-gf))
    tl.store(out_ptr + row * inter + cols, _rnd(_rnd(a, dtype) * up, dtype).to(dtype), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> Optional[torch.Tensor]:
    """out [rows, I] for x [..., 2 * I] (2-d: rows may be strided; more dims: contiguous), or None."""
    if x.dim() < 2 or x.shape[-1] % 2 or x.dtype not in DTYPES or x.stride(-1) != 1:
        return None
    if x.dim() > 2:
        if not x.is_contiguous():
            return None
        x = x.view(-1, x.shape[-1])
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    if n and inter:
        block = min(triton.next_power_of_2(inter), 4096)
        _act_and_mul_kernel[(n, triton.cdiv(inter, block))](x, x.stride(0), out, inter, GELU=gelu, BLOCK=block,
                                                            num_warps=_num_warps(block))
    return out


def silu_and_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``PlatformOps.silu_and_mul``: x [..., 2 * I] = [gate | up] (2-d: rows may be strided; more
    dims: contiguous) -> rnd(silu(gate)) * up [..., I], a new contiguous tensor; x is left as it is.
    None where the kernel does not apply."""
    orig = x.shape
    out = _act_and_mul(x, gelu=False)
    return None if out is None else out.view(*orig[:-1], orig[-1] // 2)


def gelu_tanh_and_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``PlatformOps.gelu_tanh_and_mul``: x [..., 2 * I] = [gate | up] -> rnd(gelu_tanh(gate)) * up
    [..., I] (PyTorch's ``gelu(approximate="tanh")``), as ``silu_and_mul``."""
    orig = x.shape
    out = _act_and_mul(x, gelu=True)
    return None if out is None else out.view(*orig[:-1], orig[-1] // 2)


# ----------------------------------------------------------------------------------------- RoPE
@triton.jit
def _rotary_kernel(x_ptr, x_s0, x_s1, cs_ptr, heads, rot_dim, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """Program (token, head block): x <- rnd(rnd(x * cos) + rnd(roll(x, R/2) * sin_signed)) for each head,
    cos_sin[token] = [cos (R) | sin_signed (R)]; all loads of a head precede its store."""
    tok = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_R)
    cmask = cols < rot_dim
    rolled_cols = tl.where(cols < HALF, cols + HALF, cols - HALF)
    cs = cs_ptr + tok * 2 * rot_dim
    cos = tl.load(cs + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cs + rot_dim + cols, mask=cmask, other=0.0).to(tl.float32)
    mask = (hs[:, None] < heads) & cmask[None, :]
    base = x_ptr + tok * x_s0 + hs[:, None].to(tl.int64) * x_s1
    x = tl.load(base + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    xr = tl.load(base + rolled_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = _rnd(x.to(tl.float32) * cos[None, :], dtype)
    b = _rnd(xr * sin[None, :], dtype)
    tl.store(base + cols[None, :], _rnd(a + b, dtype).to(dtype), mask=mask)


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """``PlatformOps.rotary_``: rotate x [N, h, R] (token and head strides free: a partial rotary's
    ``x[..., :R]`` view too; R contiguous and even) in place with cos_sin [N, 2, 1, R] (contiguous,
    x's dtype: ``RotaryEmbedding.cos_sin``). Returns False, x untouched, where the kernel does not apply."""
    if x.dim() != 3:
        return False
    n, h, r = x.shape
    if (r % 2 or not 0 < r <= MAX_HIDDEN or x.dtype not in DTYPES or x.stride(-1) != 1
            or cos_sin.shape != (n, 2, 1, r) or cos_sin.dtype != x.dtype or not cos_sin.is_contiguous()
            or cos_sin.device != x.device):
        return False
    if n and h:
        block_r = triton.next_power_of_2(r)
        block_h = min(triton.next_power_of_2(h), max(1, 4096 // block_r))
        _rotary_kernel[(n, triton.cdiv(h, block_h))](x, x.stride(0), x.stride(1), cos_sin, h, r, HALF=r // 2,
                                                     BLOCK_H=block_h, BLOCK_R=block_r,
                                                     num_warps=_num_warps(block_h * block_r),
                                                     enable_fp_fusion=False)  # no FMA: the native bits
    return True
