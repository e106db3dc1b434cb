"""The CPU paged-attention kernels of ``paged_attention.cpp`` (C++/OpenMP, no torch headers), built on
first use by ``build.py`` and bound with ctypes: attention that reads K/V in place through the block
table, the K/V write by slot mapping, and the int8 cache's read. The attention backend that calls them,
with its shape checks and fallbacks, is ``layers/attention/cpu_backend.py``; it passes the block size
(``AttentionMetadata.block_size``), which an int8 cache's rows do not state on their own. This module
imports nothing of ``layers``.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = BASE_FLAGS
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 1024


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, FLAGS)
    i32p, f32, i32, i64 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int64
    for fn in (lib.paged_attention_f32, lib.paged_attention_bf16, lib.paged_attention_f32_i8,
               lib.paged_attention_bf16_i8):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [i32p, i64, i32p, i32p, i32, i32, i32, i32, i32, f32, i32, f32, i32,
                                              ctypes.c_void_p]
    for fn in (lib.kv_read_int8_f32, lib.kv_read_int8_bf16):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, i64, i32, i32, i32, ctypes.c_void_p]
    for fn in (lib.kv_write_f32, lib.kv_write_bf16):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, i64, ctypes.c_void_p, i64, i32, i32,
                       ctypes.c_void_p, ctypes.c_void_p]
    for fn in (lib.kv_write_int8_f32, lib.kv_write_int8_bf16):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, i64, ctypes.c_void_p, i64, i32, i32, i32,
                       ctypes.c_void_p, ctypes.c_void_p]
    return lib


_LIBRARY = LazyLibrary(_build)


def load_kernel() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(library, None) once built and loaded, else (None, why not); tried once per process."""
    return _LIBRARY.get()


def check_operand(t: torch.Tensor, name: str, dtype: torch.dtype, ndim: int) -> None:
    """The kernels read raw pointers, so an operand in another layout must fail here (GUIDE plug
    point 5): raises ValueError unless ``t`` is a contiguous ``ndim``-d ``dtype`` CPU tensor."""
    if not t.is_cpu or t.dtype != dtype or t.dim() != ndim or not t.is_contiguous():
        raise ValueError(f"cpu paged attention: {name} must be a contiguous {ndim}-d {dtype} CPU tensor, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device} (strides {t.stride()})")
