"""The elementwise kernels of ``platforms/cpu/fused_ops.cpp`` for CPU tensors: residual add + RMSNorm,
RMSNorm per head in place (q/k norms), SiLU(gate) * up, Gemma's RMSNorm (with its post-norm residual
add) and GELU-tanh(gate) * up, and rotate-half RoPE in place, each one pass over memory instead of
2-9 ATen ops; and the sampler's row-wise argmax of float32 logits.

The CPU bodies of the seam's ops (``platforms/cpu/ops.py`` for ``platforms/ops.py``) where the
tensors are float32 or bfloat16 on a CPU and the library builds (``platforms/cpu/build.py``); each
returns None (or False) otherwise, and the seam runs its PyTorch body. ``PAGEDLLM_CPU_FUSED_OPS=0`` turns it off.
Measured on SmolLM2-135M, batch 48 decode, 2 threads: see benchmarks/README.md section 5.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Optional

import torch

from pagedllm import envs
from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("fused_ops.cpp")
# No fused multiply-adds: each product is rounded as in PyTorch's eager ops.
FLAGS = BASE_FLAGS + ["-ffp-contract=off"]
MAX_HIDDEN = 8192    # the row buffers of the RMSNorms (a row, or a head's row)
MAX_HEAD_DIM = 1024  # the row buffer of rotary


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, FLAGS)
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for sfx in ("f32", "bf16"):
        getattr(lib, f"add_rms_norm_{sfx}").argtypes = [p, i64, p, p, p, i64, i32, f32]
        getattr(lib, f"silu_and_mul_{sfx}").argtypes = [p, i64, p, i64, i32]
        getattr(lib, f"rotary_{sfx}").argtypes = [p, i64, i64, i64, i32, i32, p]
        for name in ("rms_norm_heads", "gemma_rms_norm_heads"):
            getattr(lib, f"{name}_{sfx}").argtypes = [p, i64, i64, i64, i32, i32, p, f32]
        getattr(lib, f"gemma_rms_norm_{sfx}").argtypes = [p, i64, p, f32, p, p, f32, p, i64, i32]
        getattr(lib, f"gelu_tanh_and_mul_{sfx}").argtypes = [p, i64, p, i64, i32]
        getattr(lib, f"quantize_rows_{sfx}").argtypes = [p, i64, i64, i32, p, p]
        getattr(lib, f"int8_epilogue_{sfx}").argtypes = [p, i64, i32, p, p, p, p]
        for name in ("add_rms_norm", "rms_norm_heads", "gemma_rms_norm_heads", "gemma_rms_norm", "silu_and_mul",
                     "gelu_tanh_and_mul", "rotary", "quantize_rows", "int8_epilogue"):
            getattr(lib, f"{name}_{sfx}").restype = None
    lib.argmax_rows_f32.argtypes, lib.argmax_rows_f32.restype = [p, i64, i64, i64, p], None
    return lib


_LIBRARY = LazyLibrary(_build)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
ENABLED = envs.PAGEDLLM_CPU_FUSED_OPS  # read once, at import
_logged_fallback = False
logger = logging.getLogger("pagedllm")


def _fn(name: str, *tensors: torch.Tensor):
    """The kernel ``name`` for these tensors, or None (another device or dtype, mixed dtypes, a
    last dim that is not contiguous, the switch off, or no library). Called per layer and op, so
    kept to a few attribute reads."""
    t0 = tensors[0]
    sfx = _SUFFIX.get(t0.dtype)
    if sfx is None or not ENABLED or not t0.is_cpu:  # is_cpu: 4x cheaper than device.type
        return None
    for t in tensors:
        if t.dtype != t0.dtype or t.stride(-1) != 1 or not t.is_cpu:
            return None
    lib, err = _LIBRARY.get()
    if lib is None:
        global _logged_fallback
        if not _logged_fallback:  # one line per process, as the attention backend's fallback
            _logged_fallback = True
            logger.info("cpu fused ops: PyTorch ops (the C kernels could not be built or loaded: %s)", err)
        return None
    return getattr(lib, f"{name}_{sfx}")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x [N, hidden] (rows may be strided); residual [N, hidden] contiguous, updated in place to
    residual + x first when given. Returns weight * rnd(r * rsqrt(mean(r^2) + eps)) [N, hidden]
    (r = x or the new residual; rnd: rounded to x's dtype, as transformers' LlamaRMSNorm), or None
    when the kernel does not apply (the caller then runs PyTorch)."""
    if x.dim() != 2 or x.shape[-1] > MAX_HIDDEN or weight.shape != x.shape[-1:] or not weight.is_contiguous():
        return None
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        return None
    fn = _fn("add_rms_norm", x, weight, *(() if residual is None else (residual,)))
    if fn is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    fn(x.data_ptr(), x.stride(0), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
       x.shape[0], x.shape[1], float(eps))
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> bool:
    """In place, each head's row of x [N, h, D] (token and head strides free, D contiguous) <-
    weight * rnd(x * rsqrt(mean(x^2) + eps)), add_rms_norm's arithmetic: Qwen3's q/k norms on the
    qkv projection's views; ``gemma``: rnd(x * rsqrt(mean(x^2) + eps) * (1 + weight)), all in float
    (Gemma 3's). Returns False, x untouched, when the kernel does not apply."""
    if x.dim() != 3 or x.shape[-1] > MAX_HIDDEN or weight.shape != x.shape[-1:] or not weight.is_contiguous():
        return False
    fn = _fn("gemma_rms_norm_heads" if gemma else "rms_norm_heads", x, weight)
    if fn is None:
        return False
    fn(x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], x.shape[2], weight.data_ptr(), float(eps))
    return True


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """Gemma's RMSNorm: x [N, hidden] (rows may be strided) -> rnd(x * rsqrt(mean(x^2) + eps) * (1 +
    weight)) [N, hidden], all in float (transformers' Gemma2RMSNorm); None when the kernel does not
    apply."""
    return _gemma_norms(x, None, 0.0, None, weight, eps)


def gemma_add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        next_weight: Optional[torch.Tensor] = None, next_eps: float = 0.0) -> Optional[torch.Tensor]:
    """Gemma's post-norm residual add, residual [N, hidden] (contiguous) <- rnd(residual + rnd(gnorm(x,
    weight))) in place (transformers' ``residual + post_norm(branch)``), fused with the next norm:
    returns gnorm(residual, next_weight), a new tensor, or the residual itself without next_weight;
    None, nothing touched, when the kernel does not apply."""
    if residual.shape != x.shape or not residual.is_contiguous():
        return None
    return _gemma_norms(x, weight, eps, residual, next_weight, next_eps)


def _gemma_norms(x, w_add, eps_add, residual, w_out, eps_out) -> Optional[torch.Tensor]:
    weights = [w for w in (w_add, w_out) if w is not None]
    if (x.dim() != 2 or x.shape[-1] > MAX_HIDDEN
            or any(w.shape != x.shape[-1:] or not w.is_contiguous() for w in weights)):
        return None
    fn = _fn("gemma_rms_norm", x, *weights, *(() if residual is None else (residual,)))
    if fn is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype) if w_out is not None else residual
    fn(x.data_ptr(), x.stride(0), _ptr(w_add), float(eps_add), _ptr(residual), _ptr(w_out), float(eps_out),
       out.data_ptr(), x.shape[0], x.shape[1])
    return out


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def silu_and_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x [N, 2 * I] = [gate | up] (rows may be strided) -> rnd(silu(gate)) * up [N, I], contiguous;
    None when the kernel does not apply."""
    return _act_and_mul("silu_and_mul", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x [N, 2 * I] = [gate | up] -> rnd(gelu_tanh(gate)) * up [N, I] (PyTorch's
    ``gelu(approximate="tanh")``, Gemma's MLP), contiguous; None when the kernel does not apply."""
    return _act_and_mul("gelu_tanh_and_mul", x)


def _act_and_mul(name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
    if x.dim() != 2 or x.shape[-1] % 2:
        return None
    fn = _fn(name, x)
    if fn is None:
        return None
    inter = x.shape[-1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    fn(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], inter)
    return out


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Rotate x [N, h, D] (token and head strides free, D contiguous, D even) in place with
    cos_sin [N, 2, 1, D] (contiguous: cos, then sin with the rotate-half sign folded in).
    Returns False, x untouched, when the kernel does not apply."""
    n, h, d = x.shape
    if (d % 2 or d > MAX_HEAD_DIM or cos_sin.shape != (n, 2, 1, d) or not cos_sin.is_contiguous()):
        return False
    fn = _fn("rotary", x, cos_sin)
    if fn is None:
        return False
    fn(x.data_ptr(), x.stride(0), x.stride(1), n, h, d, cos_sin.data_ptr())
    return True


def quantize_rows(x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """x [m, k] (rows may be strided) -> (int8 [m, k], float32 scale [m, 1]), bit-identical to
    ``quantization/int8.quantize_per_token`` without the TP reduction; None when the kernel does
    not apply."""
    if x.dim() != 2:
        return None
    fn = _fn("quantize_rows", x)
    if fn is None:
        return None
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    fn(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), scale.data_ptr())
    return q, scale


def int8_epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                  dtype: torch.dtype) -> Optional[torch.Tensor]:
    """acc [m, n] int32, sx [m, 1] and sw [n] float32, bias [n] in ``dtype`` or None ->
    [m, n] ``dtype`` = rnd(float(acc) * sx * sw (+ bias)), as the int8 method's PyTorch epilogue;
    None when the kernel does not apply."""
    m, n = acc.shape
    if (acc.dtype != torch.int32 or not acc.is_cpu or not acc.is_contiguous() or sx.dtype != torch.float32 or sw.dtype != torch.float32
            or not sx.is_contiguous() or not sw.is_contiguous() or sx.numel() != m or sw.numel() != n
            or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))):
        return None
    out = torch.empty(m, n, dtype=dtype)
    fn = _fn("int8_epilogue", out)
    if fn is None:
        return None
    fn(acc.data_ptr(), m, n, sx.data_ptr(), sw.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for x [M, V] (V >= 1): int64 [M], the first maximum of each row (the
    first NaN where a row has one), as torch.argmax. One C pass for float32 CPU rows with a
    contiguous last dim, else torch.argmax."""
    out = argmax_rows_or_none(x)
    return x.argmax(dim=-1) if out is None else out


def argmax_rows_or_none(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``argmax_rows`` through the kernel, or None where it does not apply."""
    fn = _fn("argmax_rows", x) if x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 else None
    if fn is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
