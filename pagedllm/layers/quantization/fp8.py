"""FP8 checkpoints (``quantization_config.quant_method == "fp8"``: DeepSeek-V3/R1, Kimi K2, Qwen3-FP8,
GLM-4.5-FP8, Mistral's FP8 releases), dequantized at load.

A quantized weight W [..., out, in] is stored as ``<name>.weight`` float8 (e4m3) and a float scale
``<name>.weight_scale_inv`` (DeepSeek's name; despite it, the multiplier) or ``<name>.weight_scale``:
- block-wise (``weight_block_size`` [br, bc], 128 x 128 in DeepSeek-V3): scale [..., ceil(out / br),
  ceil(in / bc)], one per block;
- per tensor (one value) or per output channel ([out] or [out, 1]).
W = float32(weight) * scale, as transformers' and vLLM's dequantization computes it, then cast to the
model's dtype by the loader. Activation scales (``input_scale``, ``activation_scale``) are dropped:
activations stay in the model's float dtype. Layers the checkpoint left unquantized have no scale
and pass through.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from pagedllm.layers.linear import load_full
from pagedllm.layers.quantization.int4_formats import int4_format

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, n))
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
_ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale")

# quant_method values of a checkpoint's quantization_config that the loader reads (others are refused)
# (gptq, awq, compressed-tensors: int4 weights, ``int4_formats.py``)
SUPPORTED_CHECKPOINT_METHODS = ("fp8", "mxfp4", "gptq", "awq", "compressed-tensors")


class CheckpointFormatError(ValueError):
    """A checkpoint's quantized tensors do not fit together; the message names the tensor."""


def checkpoint_quantization(hf_config: Any) -> Optional[dict]:
    """The checkpoint's ``quantization_config`` as a dict, ``quant_method`` lower-cased (None: a float
    checkpoint).

    Raises:
        ValueError: a method the loader cannot read (bitsandbytes, HQQ, ...), an FP8 format other than
            e4m3, or int4 settings ``int4_formats.int4_format`` refuses: loading it as float would give
            wrong weights.
    """
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else vars(q))
    method = str(q.get("quant_method", "")).lower()
    if method not in SUPPORTED_CHECKPOINT_METHODS:
        raise ValueError(f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which pagedllm cannot "
                         f"load; it loads float checkpoints, FP8 ones (quant_method fp8, dequantized at load), "
                         f"int4 GPTQ, AWQ and compressed-tensors ones, gpt-oss's MXFP4 and GGUF files (use a "
                         f"float, FP8 or int4 release of the model, or its GGUF)")
    if method == "fp8" and str(q.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"FP8 format {q.get('fmt')!r} is not supported (e4m3 only)")
    if method in ("gptq", "awq", "compressed-tensors"):
        int4_format({**q, "quant_method": method})  # a clear error for settings it cannot read
    return {**q, "quant_method": method}


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: Optional[list[int]] = None) -> torch.Tensor:
    """weight [..., out, in] float8 and its scale -> float32 [..., out, in].

    ``block_size`` [br, bc]: scale [..., ceil(out / br), ceil(in / bc)]; otherwise scale is one value
    or one per output channel ([..., out] or [..., out, 1]).

    Raises:
        ValueError: the scale's shape fits none of these.
    """
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    out, cols = w.shape[-2:]
    if s.numel() == 1:
        return w * s.reshape(())
    if block_size:
        br, bc = int(block_size[0]), int(block_size[1])
        if tuple(s.shape) == (*w.shape[:-2], -(-out // br), -(-cols // bc)):
            s = s.repeat_interleave(br, dim=-2)[..., :out, :].repeat_interleave(bc, dim=-1)[..., :cols]
            return w * s
    if tuple(s.shape) in ((*w.shape[:-1],), (*w.shape[:-1], 1)):
        return w * s.reshape(*w.shape[:-1], 1)
    raise ValueError(f"FP8 weight {tuple(w.shape)} with scale {tuple(s.shape)} (weight_block_size {block_size}): "
                     f"expected one scale, one per output channel, or one per block")


def dequantized(weights: Iterable[tuple[str, Any]], quant: dict) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each FP8 ``<x>.weight`` and its scale replaced by
    ``<x>.weight`` in float32 (``dequantize``); activation scales dropped; the rest unchanged.

    Raises:
        CheckpointFormatError: an FP8 weight without a scale, a scale without its weight, or a scale
            whose shape does not fit its weight.
    """
    block = quant.get("weight_block_size")
    fp8: dict[str, torch.Tensor] = {}  # module name -> its FP8 weight, waiting for the scale
    scales: dict[str, torch.Tensor] = {}  # module name -> a scale that came first
    for name, w in weights:
        if name.endswith(_ACTIVATION_SCALE_SUFFIXES):
            continue
        scale_suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_suffix is not None:
            base = name[:-len(scale_suffix)]
            if base in fp8:
                yield base + ".weight", _dequantize_named(base, fp8.pop(base), load_full(w), block)
            else:
                scales[base] = load_full(w)
            continue
        if name.endswith(".weight") and _dtype(w) in FP8_DTYPES:
            base = name[:-len(".weight")]
            if base in scales:
                yield name, _dequantize_named(base, load_full(w), scales.pop(base), block)
            else:
                fp8[base] = load_full(w)
            continue
        yield name, w
    if fp8 or scales:
        raise CheckpointFormatError(f"FP8 checkpoint: weights without a scale {sorted(fp8)[:4]}, scales without a weight "
                         f"{sorted(scales)[:4]}")


def refuse_float8(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The pairs unchanged, for a checkpoint whose config declares no FP8 quantization.

    Raises:
        CheckpointFormatError: a float8 tensor (its scales would be ignored: wrong weights).
    """
    for name, w in weights:
        if _dtype(w) in FP8_DTYPES:
            raise CheckpointFormatError(f"{name} is a float8 tensor, but config.json declares no FP8 "
                                        f"quantization_config (quant_method fp8) to read its scales with")
        yield name, w


def _dequantize_named(base: str, weight: torch.Tensor, scale: torch.Tensor, block: Optional[list[int]]) -> torch.Tensor:
    try:
        return dequantize(weight, scale, block)
    except ValueError as e:
        raise CheckpointFormatError(f"{base}.weight: {e}") from None


def _dtype(w: Any) -> Optional[torch.dtype]:
    """A tensor's dtype, or a safetensors slice's (read from its header, without loading it)."""
    if isinstance(w, torch.Tensor):
        return w.dtype
    get = getattr(w, "get_dtype", None)
    if get is None:
        return None
    return {"F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None)}.get(get())
