"""The op seam: the one place where a layer's op meets the platform's kernel.

Layers and models call these functions and never test the device or import a platform wing. Each
op first asks the current platform's body (``current_platform.ops``, a ``PlatformOps``: the CPU
wing's C kernels in ``platforms/cpu/ops.py``; CUDA's in ``platforms/cuda/ops.py``); where that
returns None (another device or dtype, a layout its kernel does not take, no kernel library) the
op runs its native torch body, ``<op>_native`` here (vLLM's ``forward_native``): the reference, any
device, which the platforms' kernels equal bit for bit (tests/test_fused_layers.py).

The platform is looked up on the first op call, not at import (asking torch for CUDA can wait),
and then held in ``_OPS``: a decode step runs these hundreds of times, so each costs one Python
call and one attribute read more than calling the kernel's wrapper directly (and saves the
``device.type`` test the layers made).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm import platforms
from pagedllm.platforms.interface import PlatformOps

INT8_QMAX = 127  # symmetric int8: [-127, 127]; -128 unused so that negation is exact
INT8_TINY = 1e-12  # the scale of an all-zero row (its int8 values are then 0)


class _Unresolved:
    """Stands in for the platform's ops until the first call: binds ``_OPS`` and answers that one."""

    def __getattr__(self, name: str):
        global _OPS
        _OPS = platforms.current_platform.ops
        return getattr(_OPS, name)


_OPS: "type[PlatformOps] | _Unresolved" = _Unresolved()

# torch>=2.4: one call into ATen instead of six from Python; in float32 it computes exactly
# x * rsqrt(mean(x^2) + eps) * weight, bit for bit the transformers formula (tests/test_layers.py).
_rms_norm = getattr(F, "rms_norm", None)


# ---------------------------------------------------------------------------------------- norms
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: weight * (x / sqrt(mean(x^2, -1) + eps)) for x [..., hidden] (rows may be strided),
    weight [hidden] -> a new tensor, x's shape and dtype. The statistics in float32, the normalized
    x rounded back to x's dtype before the weight multiply (transformers' LlamaRMSNorm)."""
    out = _OPS.rms_norm(x, weight, eps)
    return rms_norm_native(x, weight, eps) if out is None else out


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and _rms_norm is not None:
        return _rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    if _rms_norm is not None:
        return weight * _rms_norm(x.float(), weight.shape, None, eps).to(dtype)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual add fused into the norm (vLLM's ``fused_add_rms_norm``):
    residual [N, hidden] <- residual + x in place (transformers' ``residual + hidden_states``,
    rounded alike), then (rms_norm(residual) as a new tensor, residual)."""
    out = _OPS.rms_norm(x, weight, eps, residual)
    return fused_add_rms_norm_native(x, residual, weight, eps) if out is None else (out, residual)


def fused_add_rms_norm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual.add_(x)
    return rms_norm_native(residual, weight, eps), residual


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over D of each head of x [N, heads, D] (a view of the qkv projection: token and head
    strides free, D contiguous), weight [D]: Qwen3's q/k norms. In place where the platform's
    kernel applies (returns x itself, one pass, no copy), else a new tensor (x untouched); use the
    returned tensor either way."""
    if _OPS.rms_norm_heads_(x, weight, eps):
        return x
    return rms_norm(x, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast to x's
    dtype (transformers' ``Gemma2RMSNorm``): x [..., hidden] -> a new tensor, x's shape and dtype."""
    out = _OPS.gemma_rms_norm(x, weight, eps)
    return gemma_rms_norm_native(x, weight, eps) if out is None else out


def gemma_rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (1.0 + weight.float())).to(dtype)


def gemma_rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gemma_rms_norm`` over D of each head of x [N, heads, D] (Gemma 3's q/k norms): in place
    where the platform's kernel applies (returns x), else a new tensor; as ``rms_norm_heads``."""
    if _OPS.rms_norm_heads_(x, weight, eps, True):
        return x
    return gemma_rms_norm(x, weight, eps)


def gemma_add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        next_weight: Optional[torch.Tensor] = None, next_eps: float = 0.0) -> torch.Tensor:
    """Gemma's post-norm residual add: residual [N, hidden] <- residual + gemma_rms_norm(x, weight)
    in place (transformers' ``residual + post_norm(branch)``, rounded alike), fused with the next
    norm: returns gemma_rms_norm(residual, next_weight, next_eps), a new tensor, or the residual
    itself without ``next_weight``."""
    out = _OPS.gemma_add_rms_norm_(residual, x, weight, eps, next_weight, next_eps)
    if out is not None:
        return out
    residual.add_(gemma_rms_norm(x, weight, eps))
    return residual if next_weight is None else gemma_rms_norm(residual, next_weight, next_eps)


# ---------------------------------------------------------------------------------- activations
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] laid out [gate | up] (rows may be strided) -> silu(gate) * up [..., I], a new
    contiguous tensor in x's dtype (vLLM's ``SiluAndMul``). The platform's kernel leaves x as it is;
    the native body overwrites x's gate half (see ``silu_and_mul_native``): x is scratch."""
    out = _OPS.silu_and_mul(x)
    return silu_and_mul_native(x) if out is None else out


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Two kernels and one new tensor: SiLU runs in place over x's gate half, the product goes into
    a fresh contiguous tensor, which the down projection reads without a copy. The same ops in the
    same order as transformers' ``act_fn(gate_proj(x)) * up_proj(x)``."""
    i = x.shape[-1] // 2
    return torch.mul(F.silu(x[..., :i], inplace=True), x[..., i:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] = [gate | up] -> gelu_tanh(gate) * up [..., I] (PyTorch's
    ``gelu(approximate="tanh")``: Gemma's MLP), a new tensor in x's dtype; x is left as it is."""
    out = _OPS.gelu_tanh_and_mul(x)
    return gelu_tanh_and_mul_native(x) if out is None else out


def gelu_tanh_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ----------------------------------------------------------------------------------------- RoPE
def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place: x [N, h, R] (token and head strides free, R contiguous and even)
    with cos_sin [N, 2, 1, R] (cos, then sin with the rotate-half sign folded in:
    ``RotaryEmbedding.cos_sin``). Returns x."""
    if not _OPS.rotary_(x, cos_sin):
        rotary_native_(x, cos_sin)
    return x


def rotary_native_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """rot(x) = x * cos + [-x2, x1] * sin, the second term as roll(x, R/2) * [-sin, sin]: the same
    products and the same single add as transformers', so float32 results equal it bit for bit."""
    rot = x.roll(x.shape[-1] // 2, -1).mul_(cos_sin[:, 1])
    x.mul_(cos_sin[:, 0]).add_(rot)
    return x


# ------------------------------------------------------------------------------------- sampling
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for logits x [M, V]: int64 [M], the first maximum of each row (the first
    NaN where a row has one)."""
    out = _OPS.argmax_rows(x)
    return x.argmax(dim=-1) if out is None else out


# ------------------------------------------------------------------------------ float linear layers
def pack_gemm_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
    """A float weight [N, K] packed once after loading for the platform's own GEMM (the CPU's
    16-column panels, ``platforms/cpu/float_gemm.py``), a 1-d tensor in w's dtype for
    ``gemm_linear``; None where the platform has none for it (natively: never)."""
    return _OPS.pack_gemm_weight(w)


def gemm_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                n: int) -> Optional[torch.Tensor]:
    """x [M, K] (rows may be strided) @ the packed [n, K] weight's transpose (+ bias [n]) -> a new
    [M, n] tensor in x's dtype; None where x does not fit the packed form (another dtype or device:
    the caller then runs its plain weight). Raises ValueError on a K mismatch."""
    return _OPS.gemm_linear(x, packed, bias, n)


def pack_library_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
    """A float weight [N, K] in a vendor library's packed layout (oneDNN's blocked one on a CPU:
    what PyTorch's Inductor does for linear layers) for ``library_linear``; None where there is
    none (natively: never)."""
    return _OPS.pack_library_weight(w)


def library_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x [M, K] @ the ``pack_library_weight`` weight's transpose (+ bias) -> [M, N] in x's dtype;
    None where x does not fit the packed form."""
    return _OPS.library_linear(x, packed, bias)


# ----------------------------------------------------------------------------- int8 linear layers
def quantize_per_token(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [..., k] (float; rows may be strided) -> (int8 [..., k], float32 scale [..., 1])
    with ``x ~ scale * q``, symmetric per row: scale = max|row| / 127 (``INT8_TINY`` for a zero
    row). ``amax`` [..., 1] float32 overrides the rows' max |x| (the max over tensor-parallel
    ranks; clamped in place). Error per element <= scale / 2."""
    if amax is None:
        fused = _OPS.quantize_per_token(x)
        if fused is not None:
            return fused
    return quantize_per_token_native(x, amax)


def quantize_per_token_native(x: torch.Tensor, amax: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Four passes over x: |x| and its row max, one multiply by 127 / amax, one in-place round, one
    cast (measured on a CPU: ``vector_norm(ord=inf)`` and ``aminmax`` are 4-7x slower than
    ``abs().amax()``, and dividing by the scale instead of multiplying by its reciprocal is up to
    10x slower at k = 1536). ``x * (127 / amax)`` lies in [-127, 127] up to rounding: no clamp."""
    if amax is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
    amax = amax.clamp_min_(INT8_TINY)
    q = (x * (INT8_QMAX / amax)).round_().to(torch.int8)
    return q, amax.div_(INT8_QMAX)


def int8_mm(a: torch.Tensor, b: torch.Tensor, b_row_sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int8 a [m, k] x int8 b [k, n] -> exact int32 [m, n] (``torch._int_mm``'s integers). ``b`` is
    the transposed view of an [n, k] weight (``int8.int8_weight_layout``); ``b_row_sums`` int32 [n]
    (``int8_row_sums`` of that weight), where given, lets the CPU's small-batch kernel run."""
    out = _OPS.int8_mm(a, b, b_row_sums)
    return torch._int_mm(a, b) if out is None else out


def int8_row_sums(w: torch.Tensor) -> torch.Tensor:
    """int8 weight [n, k] -> int32 [n] = sum_k w[j, k]: what the int8 GEMMs take with the weight
    (the CPU kernels undo their +128 activation offset with it)."""
    return w.sum(dim=1, dtype=torch.int32)


def int8_epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """acc int32 [m, n], activation scales sx float32 [m, 1], weight scales sw float32 [n], bias [n]
    in ``dtype`` or None -> a new [m, n] ``dtype`` tensor = rnd(float(acc) * sx * sw (+ bias))."""
    out = _OPS.int8_epilogue(acc, sx, sw, bias, dtype)
    return int8_epilogue_native(acc, sx, sw, bias, dtype) if out is None else out


def int8_epilogue_native(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                         dtype: torch.dtype) -> torch.Tensor:
    out = acc.float().mul_(sx).mul_(sw)  # float32 [m, n]
    if bias is not None:
        out.add_(bias)
    return out.to(dtype)


def int8_pack_panels(w: torch.Tensor) -> Optional[torch.Tensor]:
    """int8 weight [n, k] (values in [-127, 127]) -> the platform's packed panels for
    ``int8_panel_gemm`` / ``int8_panel_linear`` (a 1-d int8 tensor), or None where it has none for
    this weight (natively: never; on a CPU: no AVX512-VNNI or AVX2, fewer than 64 columns a thread)."""
    return _OPS.int8_pack_panels(w)


def _no_panels(what: str):
    return RuntimeError(f"{what}: this platform packed no int8 panels (int8_pack_panels returned None)")


def int8_unpack_panels(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 [n, k] weight (contiguous, a new tensor) back from its ``int8_pack_panels`` panels."""
    out = _OPS.int8_unpack_panels(packed, n, k)
    if out is None:
        raise _no_panels("int8_unpack_panels")
    return out


def int8_panel_gemm(a: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int) -> torch.Tensor:
    """int8 a [m, k] (rows may be strided) @ the packed [n, k] weight's transpose -> exact int32
    [m, n]; ``wsum``: ``int8_row_sums`` of the weight. Raises ValueError on a dtype or size mismatch."""
    out = _OPS.int8_panel_gemm(a, packed, wsum, n)
    if out is None:
        raise _no_panels("int8_panel_gemm")
    return out


def int8_panel_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The whole W8A8 linear on packed panels in one call: x [m, k] float32 or bfloat16 (rows may
    be strided) -> [m, n] in x's dtype, the same bits as ``quantize_per_token`` + ``int8_panel_gemm``
    + ``int8_epilogue``; ``scale`` float32 [n], ``bias`` [n] in x's dtype or None. None where it
    does not apply (then run those three)."""
    return _OPS.int8_panel_linear(x, packed, wsum, scale, bias)


def int8_panels_only() -> bool:
    """Whether a packed int8 layer should stay on its panels at every row count: where ``int8_mm``
    of the unpacked weight is slow (a CPU with AVX2 but no VNNI: ``torch._int_mm`` is a reference
    loop there)."""
    return _OPS.int8_panels_only()


# ---------------------------------------------------------------------- GGUF blocks (ggml's layout)
def gguf_kernel_types() -> tuple[frozenset, str]:
    """(names of the ggml types, e.g. "Q4_K", whose blocks this platform multiplies as stored,
    a few words on the kernels or why there are none)."""
    return _OPS.gguf_kernel_types()


def gguf_linear(x: torch.Tensor, segments: list, n: int) -> torch.Tensor:
    """x [m, k] float (rows may be strided) @ W^T -> float32 [m, n], W given as ``segments``:
    (first output row, ggml type id, raw blocks uint8 [rows, k / block * block bytes]) that tile
    the n rows. The platform's kernel quantizes x to int8 per block of 32, of 256 against the
    K-quants (within the bound in ``platforms/cpu/gguf_gemm.py``); the native body dequantizes W (``gguf.quants``) and
    multiplies in float32: the reference."""
    out = _OPS.gguf_linear(x, segments, n)
    return gguf_linear_native(x, segments, n) if out is None else out


def gguf_linear_native(x: torch.Tensor, segments: list, n: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants  # lazily: gguf, read only for a .gguf model

    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    xf = x.float()
    for first, type_id, raw in segments:
        w = torch.from_numpy(quants.dequantize(np.asarray(raw), GGMLQuantizationType(type_id)).copy())
        out[:, first:first + w.shape[0]] = xf @ w.to(x.device).t()
    return out


# ------------------------------------------------------------------------------ mixture of experts
def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (``F.grouped_mm``) should run a MoE block's experts by default
    for x [N, H], w13 [E, 2I, H], w2 [E, H, I] instead of the per-expert loop (``fused_moe.py``):
    the platform's call (CUDA: bf16, a GPU its kernel supports, 16-byte aligned rows); natively no."""
    return _OPS.grouped_mm_supported(x, w13, w2)
