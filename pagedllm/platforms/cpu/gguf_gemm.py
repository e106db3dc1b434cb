"""The GEMM over GGUF blocks of ``platforms/cpu/gguf_gemm.cpp``: ``x @ W^T`` with ``W`` kept in its
ggml blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), the activations quantized to int8
per block of 32 (per 256 for the K-quants, as llama.cpp's Q8_K) and dotted in integers (llama.cpp's
scheme; the .cpp's header and ``gguf_kquants.h`` say how). From 4 rows of x (Q6_K: 8; prefill,
batched decode) the K-quants take a many-row GEMM instead (``gguf_panel.h``): each thread unpacks a
super-block of 64 weight rows once into a VNNI-layout panel and runs every row of x over it, with
the same integer sums (only the float additions' order differs from the row kernels).

- ``quantize_rows(x, block)``: x float [M, K] -> ``Act``: int8 values and per block of ``block``
  (``act_block(type_id)``: 32, or 256 for Q4_K/Q5_K/Q6_K) the float32 scales, plus the float32
  scaled sums per 32 or the int16 sums per 16.
- ``linear(x, segments, n)``: a whole layer, its weight given as segments of rows (a fused q/k/v or
  gate/up layer's parts) in one C call: quantization and all segments in one parallel region.
- ``gemm(type_id, act, w, out)``: the N rows of raw blocks ``w`` (uint8 [N, row bytes], a NumPy
  array such as a ``GGUFReader`` memory map, or a tensor) into ``out`` float32 [M, N] (a view; its
  rows may be strided, e.g. a fused layer's column slice).

Accuracy against the dequantized weight in float: each activation is within d / 2 of its int8
value times d (d = max |x| of its block / 127, blocks of ``act_block(type_id)``), so a dot differs
from ``x . w`` by at most sum over blocks of (d_b / 2) * sum |w| over the block, plus float32
rounding of the sums (``tests/test_gguf_gemm.py`` asserts that bound).
"""
from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from pagedllm import envs
from pagedllm.platforms.cpu import fused_ops
from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("gguf_gemm.cpp")
# ggml type id (gguf.GGMLQuantizationType) -> (name, weights a block, bytes a block)
TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
         8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
TYPE_IDS = {name: tid for tid, (name, _, _) in TYPES.items()}
K_QUANTS = (12, 13, 14)  # their activation goes in blocks of 256 (gguf_kquants.h)


def build_with(flags: list[str]) -> ctypes.CDLL:
    """The library built with ``flags`` (cached by build.py), its functions typed."""
    lib = build_library(SOURCE, flags)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_quantize_rows.argtypes = [p, i64, i32, i64, p, p, p]
    lib.gguf_quantize_rows.restype = None
    lib.gguf_quantize_rows_k.argtypes = [p, i64, i32, i64, p, p, p]
    lib.gguf_quantize_rows_k.restype = None
    lib.gguf_gemm.argtypes = [i32, p, p, p, i32, i64, p, i64, p, i64]
    lib.gguf_gemm.restype = i32
    lib.gguf_gemm_vnni.restype = i32
    lib.gguf_linear.argtypes = [p, i64, i32, i64, i32, p, p, p, p, p, i64]
    lib.gguf_linear.restype = i32
    return lib


def _build() -> ctypes.CDLL:
    if "avx2" not in _cpu_flags():
        raise RuntimeError("this CPU has no AVX2")
    return build_with(BASE_FLAGS)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


_LIBRARY = LazyLibrary(_build)


def available() -> tuple[bool, str]:
    """(True, "avx-vnni" | "avx2") where the kernels run here, else (False, why not)."""
    if not fused_ops.ENABLED:
        return False, "PAGEDLLM_CPU_FUSED_OPS=0"
    if not envs.PAGEDLLM_CPU_GGUF_KERNELS:
        return False, "PAGEDLLM_CPU_GGUF_KERNELS=0"
    lib, err = _LIBRARY.get()
    if lib is None:
        return False, f"the GGUF kernel library is unavailable ({err})"
    return True, "vnni" if lib.gguf_gemm_vnni() else "avx2"


def has_kernel(type_name: str, cols: int) -> bool:
    """Whether a ``type_name`` weight of ``cols`` input features runs on the kernels (a whole
    number of its blocks a row)."""
    tid = TYPE_IDS.get(type_name)
    return tid is not None and cols % TYPES[tid][1] == 0


def act_block(type_id: int) -> int:
    """The activation's block for weights of ggml type ``type_id``: 256 for the K-quants, else 32."""
    return 256 if type_id in K_QUANTS else 32


class Act(NamedTuple):
    """Activations quantized per ``block``: q int8 [M, K]; d float32 [M, K / block]; s: for blocks
    of 32 the float32 d * sum(q) [M, K / 32], for 256 the int16 sums of each 16 q [M, K / 16]."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    block: int = 32


def quantize_rows(x: torch.Tensor, lib: Optional[ctypes.CDLL] = None, block: int = 32) -> Act:
    """x [M, K] float (K a multiple of ``block``, 32 or 256; rows may be strided) -> ``Act``; other
    dtypes go through float32.

    Raises:
        ValueError: K not a multiple of ``block``, or a block other than 32 and 256.
    """
    lib = lib or _LIBRARY.get()[0]
    if block not in (32, 256):
        raise ValueError(f"gguf_gemm.quantize_rows: block {block} is neither 32 nor 256")
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    if k % block:
        raise ValueError(f"gguf_gemm.quantize_rows: K={k} is not a multiple of {block}")
    if block == 32:
        act = Act(torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32), torch.empty(m, k // 32), 32)
        fn = lib.gguf_quantize_rows
    else:
        act = Act(torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 256),
                  torch.empty(m, k // 16, dtype=torch.int16), 256)
        fn = lib.gguf_quantize_rows_k
    if m:
        fn(x.data_ptr(), x.stride(0), m, k, act.q.data_ptr(), act.d.data_ptr(), act.s.data_ptr())
    return act


def _address(w: Any) -> int:
    if isinstance(w, torch.Tensor):
        return w.data_ptr()
    return w.__array_interface__["data"][0]


def _check_weight(type_id: int, w: Any, k: int) -> None:
    """Raises ValueError unless ``w`` is uint8 [rows, K / block * block bytes], C-contiguous."""
    _, elems, nbytes = TYPES[type_id]
    if isinstance(w, torch.Tensor):
        ok = w.dtype == torch.uint8 and w.is_contiguous()
    else:
        ok = w.dtype == np.uint8 and w.flags.c_contiguous
    if not ok or k % elems or len(w.shape) != 2 or w.shape[1] != k // elems * nbytes:
        raise ValueError(f"gguf_gemm: {TYPES[type_id][0]} weight {tuple(w.shape)} does not fit K={k}")


def gemm(type_id: int, act: Act, w: Any, out: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> None:
    """``out`` float32 [M, N] (row stride free, columns contiguous) <- act's x @ W^T for ``w`` the
    raw blocks of type ``type_id``, uint8 [N, K / block * block bytes] C-contiguous.

    Raises:
        ValueError: a type without a kernel, an ``act`` of another block than ``act_block(type_id)``,
            or shapes that do not fit.
    """
    lib = lib or _LIBRARY.get()[0]
    if type_id not in TYPES:
        raise ValueError(f"gguf_gemm: no kernel for ggml type {type_id}")
    if act.block != act_block(type_id):
        raise ValueError(f"gguf_gemm: {TYPES[type_id][0]} takes activations in blocks of {act_block(type_id)}, "
                         f"not {act.block}")
    m, k = act.q.shape
    n = w.shape[0]
    _check_weight(type_id, w, k)
    if out.dtype != torch.float32 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"gguf_gemm: out must be float32 [{m}, {n}] with contiguous columns")
    if m and n:
        lib.gguf_gemm(type_id, act.q.data_ptr(), act.d.data_ptr(), act.s.data_ptr(), m, k, _address(w), n,
                      out.data_ptr(), out.stride(0))


# (id(segments), K, n) -> (weak references to the segments' blocks, gguf_linear's segment arguments).
# The arguments hold raw addresses and no reference: a hit is used only while every block it was
# made from is alive and is still the one at its place in ``segments`` (a freed list's id may be reused).
_PACKS: dict = {}


def _pack(segments: list, k: int, n: int) -> tuple:
    key = (id(segments), k, n)
    hit = _PACKS.get(key)
    if hit is not None and len(hit[0]) == len(segments) and all(
            ref() is seg[2] for ref, seg in zip(hit[0], segments)):
        return hit[1]
    count = len(segments)
    types, firsts = (ctypes.c_int32 * count)(), (ctypes.c_int64 * count)()
    rows, ptrs = (ctypes.c_int64 * count)(), (ctypes.c_uint64 * count)()
    for i, (first, type_id, raw) in enumerate(segments):
        if type_id not in TYPES:
            raise ValueError(f"gguf_gemm: no kernel for ggml type {type_id}")
        _check_weight(type_id, raw, k)
        if first < 0 or first + raw.shape[0] > n:
            raise ValueError(f"gguf_gemm: segment rows [{first}, {first + raw.shape[0]}) outside [0, {n})")
        types[i], firsts[i], rows[i], ptrs[i] = type_id, first, raw.shape[0], _address(raw)
    if len(_PACKS) > 4096:  # models loaded and freed in one process: drop the stale entries
        _PACKS.clear()
    pack = (count, types, firsts, rows, ptrs)
    _PACKS[key] = ([weakref.ref(seg[2]) for seg in segments], pack)
    return pack


def linear(x: torch.Tensor, segments: list, n: int, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [M, K] float (rows may be strided; other dtypes go through float32) @ W^T -> float32
    [M, n], W given as ``segments`` (first output row, ggml type id, raw blocks uint8
    [rows, K / block * block bytes]) that tile the n rows: the same values as ``quantize_rows``
    and ``gemm`` per segment, in one C call.

    Raises:
        ValueError: a type without a kernel, a segment that does not fit K or n.
    """
    lib = lib or _LIBRARY.get()[0]
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    count, types, firsts, rows, ptrs = _pack(segments, k, n)
    out = torch.empty(m, n)
    if m and lib.gguf_linear(x.data_ptr(), x.stride(0), m, k, count, types, firsts, rows, ptrs, out.data_ptr(), n):
        raise ValueError(f"gguf_gemm.linear: K={k} is not a whole number of blocks of every segment's type")
    return out
