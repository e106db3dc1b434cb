"""The small-batch int8 GEMM of ``int8_gemm_cpu.cpp`` (AVX512-VNNI): exact int32 ``a @ w.T`` for
steps of ``MIN_ROWS`` to ``MAX_ROWS`` tokens, where it beats ``torch._int_mm``; the int8 linear method
(``layers/quantization/int8.py``) calls it and falls back to ``torch._int_mm`` where it returns
None (another device, fewer or more rows, a CPU without AVX512-VNNI, no compiler, or
``PAGEDLLM_CPU_FUSED_OPS=0``). Measured in benchmarks/README.md section 9.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pagedllm.layers import cpu_fused_ops
from pagedllm.layers.cpu_build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("int8_gemm_cpu.cpp")
# Rows where the kernel ran faster than torch._int_mm in a SmolLM2 decode step (2 threads, Zen 5;
# ms a step, torch._int_mm -> kernel: 2 rows 14.9 -> 11.2, 4 rows 17.1 -> 13.0). One row: oneDNN
# has a GEMV of its own (9.4 vs 10.5 ms); from 6 rows the matmul is compute-bound and oneDNN's
# packed loop the better one.
MIN_ROWS, MAX_ROWS = 2, 5


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, BASE_FLAGS)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int8_gemm.argtypes = [p, i64, i32, i32, p, p, i32, p]
    lib.int8_gemm.restype = None
    if not lib.int8_gemm_available():
        raise RuntimeError("this CPU (or compiler) has no AVX512-VNNI")
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
    if (not MIN_ROWS <= m <= MAX_ROWS or not cpu_fused_ops.ENABLED or a.device.type != "cpu"
            or a.dtype != torch.int8 or a.stride(1) != 1 or not w.is_contiguous() or w.shape[1] != k
            or wsum.dtype != torch.int32):
        return None
    lib, _ = _LIBRARY.get()
    if lib is None:
        return None
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.int32)
    lib.int8_gemm(a.data_ptr(), a.stride(0), m, k, w.data_ptr(), wsum.data_ptr(), n, out.data_ptr())
    return out
