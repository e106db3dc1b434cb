"""int4 group-quantized weights (GPTQ, AWQ, compressed-tensors) repacked into ggml's Q4_0 / Q4_1 blocks,
so the GGUF kernels (``platforms/cpu/gguf_gemm.cpp``) multiply them as they multiply a GGUF file's.

Every one of those formats stores, after unpacking, a 4-bit code ``q`` in 0..15 per weight, and per
output row ``n`` and group ``g`` of input columns a scale ``s`` and an integer zero ``z``:
``w[n, k] = s[n, g_idx[k]] * (q[n, k] - z[n, g_idx[k]])`` (``Int4Weight``; ``g_idx[k] = k // group``
unless the checkpoint was quantized in activation order, GPTQ's desc_act).

ggml's blocks (``ggml-common.h``) hold 32 weights of a row: ``block_q4_0`` = fp16 ``d``, 16 bytes of
codes (byte j: code j in the low nibble, code j + 16 in the high one), ``w = d * (q - 8)``;
``block_q4_1`` = fp16 ``d``, fp16 ``m``, the same 16 bytes, ``w = d * q + m``. A group whose size is a
multiple of 32 splits into whole blocks, so:

- symmetric (every z is 8): Q4_0 with ``d = s``: bit-exact wherever ``s`` is a float16 value (GPTQ's and
  AWQ's scales are float16; bf16 or fp32 scales are rounded to the nearest float16);
- asymmetric: Q4_1 with ``d = s`` and ``m = fp16(-s * z)``: ``m`` is rounded, so a weight differs from
  the checkpoint's by at most half a float16 ulp of ``s * z``, ``|s * z| * 2**-11`` (below ``s / 128``
  for z <= 15: a 128th of one quantization step) -- not bit-exact.

Act order: the columns are permuted so that each group's columns lie together (``perm``, a stable
argsort of ``g_idx``); the layer then gathers its input's columns by ``perm`` before the GEMM
(``layers/quantization/gguf.py``). A group that does not fill whole 32-column blocks after sorting
(a group size that is not a multiple of 32) cannot be repacked: ``to_blocks`` says why, and the loader
dequantizes that weight instead.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import numpy as np
import torch

BLOCK = 32  # weights a ggml Q4 block
Q4_0, Q4_1 = 2, 3  # ggml type ids (gguf.GGMLQuantizationType)
_BYTES = {Q4_0: 18, Q4_1: 20}
_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1"}


class Int4Weight(NamedTuple):
    """One linear layer's int4 weight, unpacked (any of the checkpoint formats).

    q: uint8 [N, K] codes 0..15; scales: float [N, G] (float16, bfloat16 or float32, as stored);
    zeros: int16 [N, G] (0..16: GPTQ's v1 format stores z - 1, so its z may read 16); g_idx: int64 [K],
    each input column's group (0..G-1).
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] = s * (q - z), exact for float16 or bfloat16 scales (an 11-bit significand
        times an integer below 32 fits float32's 24 bits)."""
        s = self.scales.float()[:, self.g_idx]
        z = self.zeros[:, self.g_idx].float()
        return s * (self.q.float() - z)


class Int4Blocks(NamedTuple):
    """An ``Int4Weight`` repacked into ggml blocks, in the shape the GGUF linear loader takes
    (``layers/quantization/gguf.load_blocks``, as ``models.gguf.GGUFBlocks``).

    ggml_type: 2 (Q4_0) or 3 (Q4_1); type_name: "Q4_0" | "Q4_1"; raw: uint8 [N, K / 32 * 18 | 20];
    cols: K; perm: int64 [K], the input column of each block column (None: the identity);
    source: the unpacked weight (``dequantize`` is its exact float, in the checkpoint's column order).
    """

    ggml_type: int
    type_name: str
    raw: torch.Tensor
    cols: int
    perm: Optional[torch.Tensor]
    source: Int4Weight

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    def get_shape(self) -> list[int]:
        """[N, K], as a safetensors slice reports it (the loader checks it against the config)."""
        return list(self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the checkpoint's exact weights (not the rounded Q4_1 ``m``)."""
        return self.source.dequantize()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes q uint8 [N, K] (0..15), block scales d [N, K / 32] and, for Q4_1, block minimums m
    [N, K / 32] (None: Q4_0) -> ggml blocks uint8 [N, K / 32 * (18 | 20)]; d and m rounded to float16."""
    n, k = q.shape
    nb = k // BLOCK
    codes = q.reshape(n, nb, 2, 16)
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8)  # byte j: code j low, code j + 16 high
    head = [d.to(torch.float16).reshape(n, nb, 1).view(torch.uint8)]
    if m is not None:
        head.append(m.to(torch.float16).reshape(n, nb, 1).view(torch.uint8))
    return torch.cat(head + [qs], dim=2).reshape(n, -1)


def block_groups(g_idx: torch.Tensor) -> Union[tuple[Optional[torch.Tensor], torch.Tensor], str]:
    """(perm or None, group of each 32-column block [K / 32]) for ``g_idx`` [K], or why the columns do
    not split into blocks of one group each."""
    k = g_idx.numel()
    if k % BLOCK:
        return f"{k} input features are not a multiple of {BLOCK}"
    ordered = bool((g_idx[1:] >= g_idx[:-1]).all()) if k > 1 else True
    perm = None if ordered else torch.argsort(g_idx, stable=True)
    blocks = (g_idx if perm is None else g_idx[perm]).view(-1, BLOCK)
    if not bool((blocks == blocks[:, :1]).all()):
        return "its groups do not fill whole blocks of 32 input features (a group size not a multiple of 32)"
    return perm, blocks[:, 0].clone()


def to_blocks(w: Int4Weight) -> Union[Int4Blocks, str]:
    """``w`` as Q4_0 blocks (every zero 8) or Q4_1 blocks (module docstring), or a string saying why
    it cannot be repacked."""
    got = block_groups(w.g_idx)
    if isinstance(got, str):
        return got
    perm, groups = got
    q = w.q if perm is None else w.q[:, perm]
    s = w.scales.float()[:, groups]
    z = w.zeros[:, groups]
    if bool((w.zeros == 8).all()):
        raw, tid = pack_q4(q, s), Q4_0
    else:
        raw, tid = pack_q4(q, s, -s * z.float()), Q4_1
    return Int4Blocks(tid, _NAMES[tid], raw, w.q.shape[1], perm, w)


def dequantize_q4(raw: Union[torch.Tensor, np.ndarray], type_id: int) -> torch.Tensor:
    """Q4_0 / Q4_1 blocks uint8 [N, K / 32 * (18 | 20)] -> float32 [N, K] (ggml's formulas), the
    twin of ``pack_q4`` (tests hold it equal to ``gguf.quants.dequantize``)."""
    raw = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    nbytes = _BYTES[type_id]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, nbytes)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float()
    qs = blocks[:, :, nbytes - 16:].long()
    q = torch.cat([qs & 15, qs >> 4], dim=2).float()  # [n, nb, 32]
    w = d * (q - 8) if type_id == Q4_0 else d * q + blocks[:, :, 2:4].contiguous().view(torch.float16).float()
    return w.reshape(n, -1)
