"""GGUF Q8_0 weights -> the int8 method's per-output-channel parameters (no float detour kept).

Q8_0 (ggml, ``block_q8_0``) stores each row in blocks of 32 weights along k: one fp16 scale
``d`` then 32 int8 values ``qs``; a weight is ``d * qs``. Our int8 layers keep one float32 scale
per output row, so a row is requantized: ``s = max_b(d_b * max|qs_b|) / 127`` and
``q = round(d_b * qs / s)`` (error <= s / 2 per weight against the Q8_0 values). A row whose
blocks all share one ``d`` is kept exactly (``s = d``, ``q = qs``).

Use: ``set_q8_0_weight(layer, raw)`` with the GGUF tensor's raw bytes [n, k / 32 * 34] (this
rank's rows for a column-parallel layer), after which the layer's int8 method skips quantizing.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.layers.quantization.int8 import _TINY, QMAX, set_int8_weight

Q8_0_BLOCK = 32  # weights per block
Q8_0_BYTES = 2 + Q8_0_BLOCK  # fp16 scale + 32 int8


def split_q8_0(raw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q8_0 bytes (uint8 array or tensor [n, nb * 34]) -> (qs int8 [n, nb * 32], d float16 [n, nb]).

    Raises:
        ValueError: the row length is not a whole number of 34-byte blocks.
    """
    raw = torch.as_tensor(np.ascontiguousarray(raw) if isinstance(raw, np.ndarray) else raw)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % Q8_0_BYTES:
        raise ValueError(f"Q8_0 data must be uint8 [rows, blocks * {Q8_0_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    n, nb = raw.shape[0], raw.shape[1] // Q8_0_BYTES
    blocks = raw.reshape(n, nb, Q8_0_BYTES)
    d = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n, nb)
    qs = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, nb * Q8_0_BLOCK)
    return qs, d


def q8_0_to_int8_per_channel(qs: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 values ``qs`` int8 [n, k] with block scales ``d`` [n, k / 32] -> (int8 [n, k],
    float32 scale [n]) for ``set_int8_weight``. Exact for rows whose blocks share one scale,
    else requantized with error <= scale / 2 per weight."""
    n, k = qs.shape
    if k % Q8_0_BLOCK or d.shape != (n, k // Q8_0_BLOCK):
        raise ValueError(f"Q8_0 scales must be [{n}, {k // Q8_0_BLOCK}] for values [{n}, {k}], got {tuple(d.shape)}")
    d = d.float()
    q_blocks = qs.reshape(n, -1, Q8_0_BLOCK)
    w = q_blocks.float() * d[:, :, None]  # exact: an fp16 times an int8 fits float32's 24 bits
    uniform = (d == d[:, :1]).all(dim=1)
    scale = (w.abs().amax(dim=(1, 2)) / QMAX).clamp_min(_TINY)
    scale = torch.where(uniform, d[:, 0].clamp_min(_TINY), scale)
    q = torch.round(w / scale[:, None, None]).clamp_(-QMAX, QMAX).to(torch.int8).reshape(n, k)
    q = torch.where(uniform[:, None], qs.clamp(-QMAX, QMAX), q)  # Q8_0 never writes -128, but be safe
    return q, scale


def set_q8_0_weight(layer: nn.Module, raw: Any) -> None:
    """Load a GGUF Q8_0 tensor's raw bytes [n_rows_of_this_rank, k / 32 * 34] into an int8 layer."""
    qs, d = split_q8_0(raw)
    q, scale = q8_0_to_int8_per_channel(qs, d)
    device = layer.weight.device if hasattr(layer, "weight") else layer.weight_q.device
    set_int8_weight(layer, q.to(device), scale.to(device))
