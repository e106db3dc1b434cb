"""The float GEMM of ``platforms/cpu/float_gemm.cpp`` for CPU linear layers: ``y = x @ W.T + b`` in float32
(AVX-512, or AVX2 with FMA) or bfloat16 (AVX512-BF16's bf16 products; on AVX2 without AVX-512, bf16
values widened to float32 as they load), float32 accumulation, with ``W`` packed once after loading
(``pack``) into 16-column panels that each thread shares out evenly.

``layers/quantization/unquantized.py`` runs it (through the seam: ``platforms/cpu/ops.py``) where it
applies (``supported``), and oneDNN's packed linear elsewhere. Why: at decode-sized batches oneDNN splits a few-hundred-column matmul unevenly
over the threads; measured in benchmarks/README.md section 10. ``PAGEDLLM_CPU_FLOAT_GEMM=0`` turns it
off (read once, at import).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pagedllm import envs
from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("float_gemm.cpp")
ENABLED = envs.PAGEDLLM_CPU_FLOAT_GEMM  # read once, at import
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_LEVEL = {torch.float32: 1, torch.bfloat16: 2}  # float_gemm_level() needed for the dtype
PANEL = 16  # columns per packed panel
_GEMM: dict = {}  # dtype -> the library's GEMM for it, once built


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, BASE_FLAGS)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.float_gemm_level.restype = i32
    level = lib.float_gemm_level()
    if level < 1:
        raise RuntimeError("this CPU (or compiler) has neither AVX-512 nor AVX2 with FMA")
    for sfx in ("f32", "bf16")[:level]:
        getattr(lib, f"float_gemm_packed_elems_{sfx}").argtypes = [i32, i32]
        getattr(lib, f"float_gemm_packed_elems_{sfx}").restype = i64
        getattr(lib, f"float_gemm_pack_{sfx}").argtypes = [p, i32, i32, p]
        getattr(lib, f"float_gemm_pack_{sfx}").restype = None
        getattr(lib, f"float_gemm_{sfx}").argtypes = [p, i64, p, p, p, i64, i32, i32, i32]
        getattr(lib, f"float_gemm_{sfx}").restype = None
    for dtype, sfx in _SUFFIX.items():
        if _LEVEL[dtype] <= level:
            _GEMM[dtype] = getattr(lib, f"float_gemm_{sfx}")
    return lib


_LIBRARY = LazyLibrary(_build)


def fills_threads(n: int) -> bool:
    """Whether an n-column weight gives each of torch's threads at least 4 panels (64 columns):
    the rule of every panel GEMM on panel_gemm.h's loops (this file's and int8_gemm_cpu's)."""
    return n >= 4 * PANEL * torch.get_num_threads()


def supported(w: torch.Tensor) -> bool:
    """Whether ``pack(w)`` applies: a 2-d float32/bfloat16 CPU weight, the switch on, the library
    built with that dtype's kernel, and at least 4 panels (64 columns) for each of torch's threads
    (fewer: each thread's share gets too narrow to feed its register tile, and oneDNN, which also
    splits rows, is kept)."""
    if (not ENABLED or w.device.type != "cpu" or w.dtype not in _SUFFIX or w.dim() != 2 or w.numel() == 0
            or not fills_threads(w.shape[0])):
        return False
    lib, _ = _LIBRARY.get()
    return lib is not None and lib.float_gemm_level() >= _LEVEL[w.dtype]


def packed_elems(n: int, k: int, dtype: torch.dtype) -> int:
    """Elements of the packed form of an [n, k] weight (bfloat16: k rounded up to pairs)."""
    return -(-n // PANEL) * PANEL * (k if dtype == torch.float32 else k + (k & 1))


def pack(w: torch.Tensor) -> torch.Tensor:
    """Weight [N, K] (float32 or bfloat16) -> its packed panels, a 1-d tensor of the same dtype
    (``platforms/cpu/float_gemm.cpp`` gives the layout; ceil(N / 16) * 16 columns, zero past N). Call only
    where ``supported(w)``."""
    lib, _ = _LIBRARY.get()
    sfx = _SUFFIX[w.dtype]
    n, k = w.shape
    w = w.contiguous()
    out = torch.empty(packed_elems(n, k, w.dtype), dtype=w.dtype)
    if out.numel() != getattr(lib, f"float_gemm_packed_elems_{sfx}")(n, k):  # Python and C disagree on the layout
        raise RuntimeError(f"float_gemm_cpu: packed size mismatch for [{n}, {k}] {w.dtype}")
    getattr(lib, f"float_gemm_pack_{sfx}")(w.data_ptr(), n, k, out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ the packed [N, K] weight's transpose (+ bias [N]) -> a new
    contiguous [M, N] tensor in x's dtype. x, packed and bias must share the dtype ``pack`` saw;
    raises ValueError otherwise or when x's K does not match the packed size. Called per layer and
    step: kept to a few attribute reads before the C call."""
    dtype = x.dtype
    fn = _GEMM.get(dtype)
    if fn is None or packed.dtype != dtype or (bias is not None and bias.dtype != dtype):
        raise ValueError(f"float_gemm_cpu.linear: dtypes x {dtype}, packed {packed.dtype}, "
                         f"bias {None if bias is None else bias.dtype} must match (float32 or bfloat16, "
                         f"packed by pack())")
    m, k = x.shape
    if packed.numel() != packed_elems(n, k, dtype):
        raise ValueError(f"float_gemm_cpu.linear: x has {k} features, not those of the packed [{n}, ?] weight")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.empty(m, n, dtype=dtype)
    if m:
        fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
           n, m, n, k)
    return y
