"""MXFP4 weights, as gpt-oss checkpoints store their experts (OCP Microscaling Formats v1.0: FP4 E2M1
elements in blocks of 32 that share one E8M0 power-of-two scale).

A tensor W [..., rows, cols] is stored as ``<name>_blocks`` uint8 [..., rows, cols / 32, 16] (two
4-bit codes a byte, the low nibble first) and ``<name>_scales`` uint8 [..., rows, cols / 32] (the
block's exponent + 127). Code c is the E2M1 value ``FP4_VALUES[c]``; an element is that value times
2^(scale - 127). Dequantized at load into the model's dtype (exact in float32 and bfloat16: every
value is a small power-of-two multiple of 0.5), as transformers does on a machine without its
Triton MXFP4 kernels (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``).
"""
from __future__ import annotations

import torch

# E2M1: sign, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in ``dtype``.

    Raises:
        ValueError: the shapes do not pair up (blocks' leading dimensions must equal the scales').
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, 16] with scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    # Low nibble first: element 2i of a block is byte i's low 4 bits, element 2i + 1 its high 4.
    vals = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    exps = scales.to(torch.int32) - 127
    out = torch.ldexp(vals.flatten(-2), exps.unsqueeze(-1))  # [..., G, 32]
    return out.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] (cols a multiple of 32) -> (blocks, scales) whose ``dequantize`` is w rounded to
    MXFP4 (each block's scale the smallest power of two that puts its largest |x| at most 6, the
    largest code; values to the nearest E2M1 code). For tests and tools that write MXFP4 checkpoints."""
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs a last dimension divisible by 32, got {tuple(w.shape)}")
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(-1).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # largest |x| / 2^e in (3, 6]
    y = x / torch.ldexp(torch.ones_like(e), e.int()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    mag = (y.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # the nearest magnitude code (0 .. 7)
    codes = (mag | ((y < 0).long() << 3)).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.to(torch.uint8), (e.int() + 127).to(torch.uint8)
