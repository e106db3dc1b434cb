"""The small-batch int8 GEMM of ``int8_gemm_cpu.cpp`` (AVX512-VNNI): exact int32 ``a @ w.T`` for
steps of at most ``MAX_ROWS`` tokens, where it beats ``torch._int_mm``; the int8 linear method
(``layers/quantization/int8.py``) calls it and falls back to ``torch._int_mm`` where it returns
None (another device, more rows, a CPU without AVX512-VNNI, no compiler, or
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
# Rows up to which the kernel ran faster than torch._int_mm on SmolLM2's shapes (2 threads,
# AVX512-VNNI): it is compute-bound past that, where oneDNN's packed gemm is the better loop.
MAX_ROWS = 5


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
    if (m > MAX_ROWS or not cpu_fused_ops.ENABLED or a.device.type != "cpu" or a.dtype != torch.int8
            or a.stride(1) != 1 or not w.is_contiguous() or w.shape[1] != k or wsum.dtype != torch.int32):
        return None
    lib = _LIBRARY.lib
    if lib is None:
        lib, _ = _LIBRARY.get()
        if lib is None:
            return None
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.int32)
    lib.int8_gemm(a.data_ptr(), a.stride(0), m, k, w.data_ptr(), wsum.data_ptr(), n, out.data_ptr())
    return out
