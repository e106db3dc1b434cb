"""GGUF Q8_0 weights -> the int8 method's per-output-channel parameters (no float detour kept).

Q8_0 (ggml, ``block_q8_0``) stores each row in blocks of 32 weights along k: one fp16 scale
``d`` then 32 int8 values ``qs``; a weight is ``d * qs``. Our int8 layers keep one float32 scale
per output row, so a row is requantized: ``s = max_b(d_b * max|qs_b|) / 127`` and
``q = round(d_b * qs / s)`` (error <= s / 2 per weight against the Q8_0 values). A row whose
blocks all share one ``d`` is kept exactly (``s = d``, ``q = qs``).

Use: ``set_q8_0_weight(layer, raw)`` with the GGUF tensor's raw bytes [n, k / 32 * 34] (this
rank's rows for a column-parallel layer), after which the layer's int8 method skips quantizing.

Loading a GGUF file (``models/loader.py``, ``--quantization int8`` without SmoothQuant): the
linear layers' weight loaders hand a ``Q8_0Weight`` (int8 values + float16 block scales) to
``load_q8_0``, which keeps both in buffers shaped like the layer's weight through the layer's own
loader (so the tensor-parallel slice and the fused q/k/v or gate/up offsets are the float ones);
after loading, ``finish_q8_0`` turns them into the int8 method's per-channel weights, or into the
float weight for a layer that stays float (or one whose rows came partly from other types).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce_max
from pagedllm.layers.quantization import gguf as gguf_blocks
from pagedllm.layers.quantization.int8 import set_int8_weight
from pagedllm.platforms.ops import INT8_QMAX as QMAX, INT8_TINY as _TINY

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


def q8_0_to_int8_per_channel(qs: torch.Tensor, d: torch.Tensor, amax: Optional[torch.Tensor] = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 values ``qs`` int8 [n, k] with block scales ``d`` [n, k / 32] -> (int8 [n, k],
    float32 scale [n]) for ``set_int8_weight``. Exact for rows whose blocks share one scale,
    else requantized with error <= scale / 2 per weight. ``amax`` [n] overrides the rows' max
    |weight| (a row-parallel layer passes the max over ranks; a row is then kept exactly only if
    its scale is still its blocks' shared one)."""
    n, k = qs.shape
    if k % Q8_0_BLOCK or d.shape != (n, k // Q8_0_BLOCK):
        raise ValueError(f"Q8_0 scales must be [{n}, {k // Q8_0_BLOCK}] for values [{n}, {k}], got {tuple(d.shape)}")
    d = d.float()
    q_blocks = qs.reshape(n, -1, Q8_0_BLOCK)
    w = q_blocks.float() * d[:, :, None]  # exact: an fp16 times an int8 fits float32's 24 bits
    uniform = (d == d[:, :1]).all(dim=1)
    if amax is None:
        scale = (w.abs().amax(dim=(1, 2)) / QMAX).clamp_min(_TINY)
        scale = torch.where(uniform, d[:, 0].clamp_min(_TINY), scale)
    else:
        scale = (amax.float() / QMAX).clamp_min(_TINY)
        uniform &= scale == d[:, 0]
    q = torch.round(w / scale[:, None, None]).clamp_(-QMAX, QMAX).to(torch.int8).reshape(n, k)
    q = torch.where(uniform[:, None], qs.clamp(-QMAX, QMAX), q)  # Q8_0 never writes -128, but be safe
    return q, scale


def set_q8_0_weight(layer: nn.Module, raw: Any) -> None:
    """Load a GGUF Q8_0 tensor's raw bytes [n_rows_of_this_rank, k / 32 * 34] into an int8 layer."""
    qs, d = split_q8_0(raw)
    q, scale = q8_0_to_int8_per_channel(qs, d)
    device = layer.weight.device if hasattr(layer, "weight") else layer.weight_q.device
    set_int8_weight(layer, q.to(device), scale.to(device))


def is_q8_0(loaded: Any) -> bool:
    """A GGUF tensor kept quantized: Q8_0 for the int8 method (``models.gguf.Q8_0Weight``:
    ``qweight``, ``scales``), or any type kept in its ggml blocks (``models.gguf.GGUFBlocks``,
    for ``gguf.GGUFLinearMethod``); the linear layers' loaders send both here."""
    return (hasattr(loaded, "qweight") and hasattr(loaded, "scales")) or gguf_blocks.is_blocks(loaded)


def load_q8_0(layer: nn.Module, loader: Callable, param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
    """A linear layer's weight loader given a Q8_0 tensor: its int8 values and float16 block scales
    go into ``layer.q8_0_qs`` [n, k] and ``layer.q8_0_d`` [n, k / 32] (NaN until a row is loaded)
    through ``loader`` (the layer's own, so slicing and fused offsets match the float path).
    A weight whose per-rank width is not a whole number of blocks is dequantized instead."""
    if gguf_blocks.is_blocks(loaded):
        gguf_blocks.load_blocks(layer, loader, param, loaded, shard_id)
        return
    w = layer.weight
    if param is not w or w.shape[1] % Q8_0_BLOCK:
        loader(param, loaded.dequantize(), shard_id)
        return
    if getattr(layer, "q8_0_qs", None) is None:
        layer.q8_0_qs = torch.zeros(w.shape, dtype=torch.int8, device=w.device)
        layer.q8_0_d = torch.full((w.shape[0], w.shape[1] // Q8_0_BLOCK), float("nan"), dtype=torch.float16,
                                  device=w.device)
    loader(layer.q8_0_qs, loaded.qweight, shard_id)
    loader(layer.q8_0_d, loaded.scales, shard_id)


def finish_q8_0(layer: nn.Module, to_int8: bool) -> bool:
    """After loading: when ``to_int8`` and every row of the layer came from Q8_0, give it int8
    per-channel weights (row-parallel layers take the max |weight| over ranks, as the int8 method
    does) and return True; otherwise write the Q8_0 rows into the float weight (exact: an fp16
    times an int8 fits float32) and return False. The buffers are dropped either way."""
    qs, d = layer.__dict__.pop("q8_0_qs"), layer.__dict__.pop("q8_0_d")
    rows = ~torch.isnan(d).any(dim=1)
    if to_int8 and bool(rows.all()):
        amax = None
        if getattr(layer, "input_is_parallel", False) and getattr(layer, "tp_size", 1) > 1:
            w = qs.float().view(qs.shape[0], -1, Q8_0_BLOCK) * d.float()[:, :, None]
            amax = tensor_model_parallel_all_reduce_max(w.abs().amax(dim=(1, 2)))  # this stage's TP group
        q, scale = q8_0_to_int8_per_channel(qs, d, amax)
        set_int8_weight(layer, q, scale)
        return True
    deq = qs[rows].float().view(-1, qs.shape[1] // Q8_0_BLOCK, Q8_0_BLOCK) * d[rows].float()[:, :, None]
    layer.weight.data[rows] = deq.view(-1, qs.shape[1]).to(layer.weight.dtype)
    return False
