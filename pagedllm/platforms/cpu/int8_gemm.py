"""The int8 GEMMs of ``platforms/cpu/int8_gemm.cpp`` (AVX512-VNNI; the panel GEMM on AVX2 too), exact int32
``a @ w.T``:

- ``int8_gemm``: steps of ``MIN_ROWS`` to ``MAX_ROWS`` tokens over the layer's own [n, k] weight,
  where it beats ``torch._int_mm``; the int8 linear method (``layers/quantization/int8.py``) runs
  it through the seam (``platforms/cpu/ops.py``: ``int8_mm``) and falls back to ``torch._int_mm`` where it returns None (another device, fewer or more
  rows, a CPU without AVX512-VNNI, no compiler, or ``PAGEDLLM_CPU_FUSED_OPS=0``). Measured in
  benchmarks/README.md section 9.
- ``panel_gemm``: any number of rows over a weight packed once into 16-column panels
  (``panel_pack``); the int8 LM head runs on it (its rows are the step's sequences, never a
  prefill's tokens): 2x ``torch._int_mm`` at 48 rows on SmolLM2's 49,152 x 576 head
  (benchmarks/README.md section 10). On an AVX2 CPU without VNNI it is the only int8 GEMM that
  runs at speed (``torch._int_mm`` measured 2 GOP/s there, a reference loop; the panels 30x
  that), so every step of a packed layer stays on it (``int_mm_is_slow``).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pagedllm.platforms.cpu import fused_ops as cpu_fused_ops, float_gemm as float_gemm_cpu
from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("int8_gemm.cpp")
# Rows where the kernel ran faster than torch._int_mm in a SmolLM2 decode step (2 threads, Zen 5;
# ms a step, torch._int_mm -> kernel: 2 rows 14.9 -> 11.2, 4 rows 17.1 -> 13.0). One row: oneDNN
# has a GEMV of its own (9.4 vs 10.5 ms); from 6 rows the matmul is compute-bound and oneDNN's
# packed loop the better one.
MIN_ROWS, MAX_ROWS = 2, 5


# No fused multiply-adds: panel_linear's epilogue rounds each product as int8_epilogue does.
FLAGS = BASE_FLAGS + ["-ffp-contract=off"]


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, FLAGS)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int8_gemm.argtypes = [p, i64, i32, i32, p, p, i32, p]
    lib.int8_gemm.restype = None
    lib.int8_panel_elems.argtypes = [i32, i32]
    lib.int8_panel_elems.restype = i64
    lib.int8_panel_pack.argtypes = [p, i32, i32, p]
    lib.int8_panel_pack.restype = None
    lib.int8_panel_unpack.argtypes = [p, i32, i32, p]
    lib.int8_panel_unpack.restype = None
    lib.int8_panel_gemm.argtypes = [p, i64, i32, i32, p, p, i32, p]
    lib.int8_panel_gemm.restype = None
    for fn in (lib.int8_panel_linear_f32, lib.int8_panel_linear_bf16):
        fn.argtypes, fn.restype = [p, i64, i32, i32, p, p, p, p, i32, p], None
    lib.int8_panel_level.restype = i32
    if lib.int8_panel_level() < 1:
        raise RuntimeError("this CPU (or compiler) has neither AVX512-VNNI nor AVX2")
    lib.small_batch = bool(lib.int8_gemm_available())  # read once: int8_gemm asks per call
    return lib


_LIBRARY = LazyLibrary(_build)


def weight_row_sums(w: torch.Tensor) -> torch.Tensor:
    """int8 weight [n, k] -> int32 [n]: sum_k w[j, k], the kernel's correction for its +128 offset."""
    return w.sum(dim=1, dtype=torch.int32)


def int8_gemm(a: torch.Tensor, w: torch.Tensor, wsum: torch.Tensor) -> Optional[torch.Tensor]:
    """a int8 [m, k] (rows may be strided), w int8 [n, k] contiguous, wsum int32 [n] from
    ``weight_row_sums(w)`` -> int32 [m, n] = a @ w.T, bit-identical to ``torch._int_mm``; None
    when the kernel does not apply (see the module docstring)."""
    m, k = a.shape
    if (not MIN_ROWS <= m <= MAX_ROWS or not cpu_fused_ops.ENABLED or not a.is_cpu
            or a.dtype != torch.int8 or a.stride(1) != 1 or not w.is_contiguous() or w.shape[1] != k
            or wsum.dtype != torch.int32):
        return None
    lib, _ = _LIBRARY.get()
    if lib is None or not lib.small_batch:
        return None
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.int32)
    lib.int8_gemm(a.data_ptr(), a.stride(0), m, k, w.data_ptr(), wsum.data_ptr(), n, out.data_ptr())
    return out


def _panel_elems(n: int, k: int) -> int:
    """Bytes of an [n, k] weight's panels (int8_panel_elems in the .cpp: 16 columns x 4 k a row)."""
    return -(-n // 16) * 64 * -(-k // 4)


def panel_supported(w: torch.Tensor) -> bool:
    """Whether ``panel_pack(w)`` applies: an int8 [n, k] CPU weight, the switch on, the library
    built (AVX512-VNNI or AVX2), and at least 64 columns for each of torch's threads. The weight
    must lie in [-127, 127] (the AVX2 kernel cannot negate -128; the int8 method never writes it)."""
    if (not cpu_fused_ops.ENABLED or w.device.type != "cpu" or w.dtype != torch.int8 or w.dim() != 2
            or not float_gemm_cpu.fills_threads(w.shape[0])):
        return False
    lib, _ = _LIBRARY.get()
    return lib is not None


def int_mm_is_slow() -> bool:
    """True where the panels run on AVX2 without VNNI: there ``torch._int_mm`` is a reference loop
    (2 GOP/s on a 2-core EPYC, against 60 for the panels at 48 rows), so no step leaves the panels."""
    lib, _ = _LIBRARY.get()
    return lib is not None and lib.int8_panel_level() == 1


def panel_pack(w: torch.Tensor) -> torch.Tensor:
    """int8 weight [n, k] -> its 16-column panels for ``panel_gemm`` (a 1-d int8 tensor; layout in
    ``platforms/cpu/int8_gemm.cpp``). Call only where ``panel_supported(w)``."""
    lib, _ = _LIBRARY.get()
    n, k = w.shape
    w = w.contiguous()
    out = torch.empty(lib.int8_panel_elems(n, k), dtype=torch.int8)
    lib.int8_panel_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def panel_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 [n, k] weight (contiguous) back from its panels ``panel_pack(w)``: one pass over
    n * k bytes, for steps with rows enough that ``torch._int_mm`` beats the panel loop. Call
    only where ``panel_supported`` held for the packed weight."""
    lib, _ = _LIBRARY.get()
    out = torch.empty(n, k, dtype=torch.int8)
    lib.int8_panel_unpack(packed.data_ptr(), n, k, out.data_ptr())
    return out


def panel_gemm(a: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int) -> torch.Tensor:
    """a int8 [m, k] (rows may be strided) @ the packed [n, k] weight's transpose -> int32 [m, n],
    exact (the same integers as ``torch._int_mm``). Raises ValueError on a dtype or size mismatch."""
    m, k = a.shape
    if (a.dtype != torch.int8 or packed.dtype != torch.int8 or wsum.dtype != torch.int32 or wsum.numel() != n
            or packed.numel() != _panel_elems(n, k)):
        raise ValueError(f"int8_gemm_cpu.panel_gemm: a {a.dtype} [{m}, {k}], packed {packed.dtype} "
                         f"({packed.numel()} bytes), wsum {wsum.dtype} [{wsum.numel()}] do not fit n={n}")
    if a.stride(1) != 1:
        a = a.contiguous()
    out = torch.empty(m, n, dtype=torch.int32)
    if m:
        lib, _ = _LIBRARY.get()
        lib.int8_panel_gemm(a.data_ptr(), a.stride(0), m, k, packed.data_ptr(), wsum.data_ptr(), n, out.data_ptr())
    return out


_LINEAR = {torch.float32: "int8_panel_linear_f32", torch.bfloat16: "int8_panel_linear_bf16"}


def panel_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The W8A8 linear on a packed weight in one call: x [m, k] float32 or bf16 (rows may be
    strided), quantized per row inside -> [m, n] in x's dtype, the same bits as
    ``quantize_rows`` + ``panel_gemm`` + ``int8_epilogue``. ``scale``: the weight's float32 [n];
    ``bias``: [n] in x's dtype or None. None where it does not apply (then run those three)."""
    name = _LINEAR.get(x.dtype)
    n = wsum.numel()
    if (name is None or x.dim() != 2 or not x.is_cpu or x.stride(1) != 1 or scale.dtype != torch.float32
            or not scale.is_contiguous() or scale.numel() != n
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != n))):
        return None
    m, k = x.shape
    if packed.numel() != _panel_elems(n, k):
        raise ValueError(f"int8_gemm_cpu.panel_linear: packed weight of {packed.numel()} bytes does not fit "
                         f"[{n}, {k}]")
    lib, _ = _LIBRARY.get()
    out = torch.empty(m, n, dtype=x.dtype)
    if m:
        getattr(lib, name)(x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), wsum.data_ptr(), scale.data_ptr(),
                           0 if bias is None else bias.data_ptr(), n, out.data_ptr())
    return out
