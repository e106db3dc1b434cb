"""The CPU kernel of the batched LoRA op (``platforms/cpu/lora_ops.cpp``): one target linear's grouped
shrink and expand over a step's tokens of many adapters, in one C call with float32 sums.

The CPU layer runner (``platforms/cpu/layer_runner.py``) calls it inside its layer loop after each target
linear; ``lora_add`` here calls the same kernel from Python (tests compare it with
``pagedllm.lora.ops.lora_add_reference``). Slot tables as ``pagedllm/lora/layers.py`` keeps them:
A [slots, S * R, in], Bt [slots, R, out] (B transposed, the scale folded in), in x's dtype.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pagedllm.platforms.cpu.build import BASE_FLAGS, LazyLibrary, build_library

SOURCE = Path(__file__).with_name("lora_ops.cpp")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


def _build() -> ctypes.CDLL:
    lib = build_library(SOURCE, BASE_FLAGS)
    for sfx in _SUFFIX.values():
        fn = getattr(lib, f"lora_add_{sfx}")
        fn.argtypes = [_p, _i64, _p, _i64, _i64, _i64, _p, _p, _p, _i64, ctypes.c_int, _p, _p, _p, _p, _i64, _p]
        fn.restype = None
    return lib


_LIBRARY = LazyLibrary(_build)


def kernel_address(dtype: torch.dtype) -> Optional[int]:
    """The address of the kernel for ``dtype`` (float32 or bfloat16), None where it is unavailable."""
    lib, _ = _LIBRARY.get()
    if lib is None or dtype not in _SUFFIX:
        return None
    return ctypes.cast(getattr(lib, f"lora_add_{_SUFFIX[dtype]}"), ctypes.c_void_p).value


def group_tensors(order: torch.Tensor, bounds: list[tuple[int, int]], slots: list[int]) -> tuple[torch.Tensor, ...]:
    """(order, group_start [G + 1], group_slot [G]) as the kernel reads them (int64, contiguous) from a
    ``LoRAStep``'s fields."""
    starts = [lo for lo, _ in bounds] + [bounds[-1][1] if bounds else 0]
    return (order.to(torch.int64).contiguous(), torch.tensor(starts, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64))


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, ranks: torch.Tensor,
             slice_bounds: list[int], order: torch.Tensor, bounds: list[tuple[int, int]], slots: list[int]) -> None:
    """y [N, out] += each grouped token's LoRA term, in place (the kernel; see the module docstring).

    x [N, in], y [N, out] with unit column stride; a [slots, S * R, in], bt [slots, R, out] contiguous;
    ranks [slots] int32; slice_bounds: S + 1 output offsets (0, ..., out); order, bounds, slots: a
    ``LoRAStep``'s grouping. Raises RuntimeError when the kernel is unavailable, ValueError on a shape
    or dtype it does not take."""
    lib, err = _LIBRARY.get()
    if lib is None or x.dtype not in _SUFFIX:
        raise RuntimeError(f"no CPU LoRA kernel for {x.dtype} ({err or 'unsupported dtype'})")
    n_slices = len(slice_bounds) - 1
    if (y.dtype != x.dtype or a.dtype != x.dtype or bt.dtype != x.dtype or ranks.dtype != torch.int32
            or x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not bt.is_contiguous()
            or a.shape[1] != n_slices * bt.shape[1] or a.shape[2] != x.shape[1] or bt.shape[2] != y.shape[1]
            or slice_bounds[0] != 0 or slice_bounds[-1] != y.shape[1]):
        raise ValueError("lora_add: shapes, strides or dtypes the kernel does not take")
    order_t, starts, group_slot = group_tensors(order, bounds, slots)
    h = torch.empty(max(1, order_t.numel()), n_slices * bt.shape[1], dtype=torch.float32)
    sb = torch.tensor(slice_bounds, dtype=torch.int64)
    ranks = ranks.contiguous()
    fn = getattr(lib, f"lora_add_{_SUFFIX[x.dtype]}")
    fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], y.shape[1], a.data_ptr(), bt.data_ptr(),
       ranks.data_ptr(), bt.shape[1], n_slices, sb.data_ptr(), order_t.data_ptr(), starts.data_ptr(),
       group_slot.data_ptr(), len(slots), h.data_ptr())

