"""A prompt's images once processed: the expanded prompt token ids and, per image, where its
placeholder tokens sit, its content hash and the tensors its vision tower encodes (vLLM's
``MultiModalFeatureSpec`` / ``PlaceholderRange``, our own fields).

These are msgspec Structs so that the same objects travel from the API server process to an engine
core process inside ``core_protocol.AddRequest`` (MessagePack; tensors as raw bytes + dtype + shape):
the front end runs the processor (decode, resize, normalize, placeholder expansion) once, the core
only encodes. Sending the processed pixels rather than the image file costs more bytes (a 448x448
image: 2.4 MB float32 against ~0.1-0.5 MB PNG) but keeps decoding and resizing out of the core's
single step loop, and the front end must run the processor anyway to know the prompt's length.
"""
from __future__ import annotations

from typing import Optional

import msgspec
import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8}


class TensorData(msgspec.Struct, array_like=True):
    """A CPU tensor as bytes: ``dtype`` (a key of _DTYPES), ``shape``, ``data`` (C order)."""
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorData":
        t = t.detach().to("cpu").contiguous()
        name = str(t.dtype).replace("torch.", "")
        if name not in _DTYPES:
            raise ValueError(f"cannot send a {name} tensor")
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # (NumPy has no bfloat16)
        return cls(name, list(t.shape), raw.numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        """The tensor (a new CPU tensor that owns its memory)."""
        dtype = _DTYPES[self.dtype]
        if dtype == torch.bfloat16:
            arr = np.frombuffer(self.data, np.int16).copy()
            return torch.from_numpy(arr).view(torch.bfloat16).reshape(self.shape)
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        return torch.from_numpy(np.frombuffer(self.data, np_dtype).copy()).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True):
    """One image of a prompt.

    identifier: hex sha256 of the image's decoded pixels (mode, size, bytes: ``hasher.py``) and the
        processor's output shape; the encoder cache's key and part of the prefix-cache block hashes.
    offset, length: its placeholder span in the prompt token ids, [offset, offset + length).
    data: the tensors its family's ``VisionTower.encode`` takes for this image (e.g. ``pixel_values``
        [3, H, W]; Qwen2-VL: patches [P, C*T*p*p] and ``image_grid_thw`` [3]), from the HF processor.
    is_embed: None when every token of the span takes one embedding row (LLaVA, Gemma 3, Qwen2-VL);
        else one bool per span token, True where an embedding row goes (Pixtral's [IMG_BREAK] and
        [IMG_END] tokens keep their text embedding). The encoder returns sum(is_embed) rows.
    """
    identifier: str
    offset: int
    length: int
    data: dict[str, TensorData]
    is_embed: Optional[list[bool]] = None
    modality: str = "image"

    @property
    def num_embeds(self) -> int:
        """Rows the encoder returns for it."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.tensor() for k, v in self.data.items()}


class MultiModalInputs(msgspec.Struct, array_like=True):
    """A processed prompt: token ids with each image's placeholders expanded, its images (in prompt
    order), and, for a model with M-RoPE (Qwen2-VL), the prompt's 3-row positions [3, L] int64 and
    the delta that positions after the prompt add to the token index (generated token i of a prompt
    of L tokens has position L + i + delta on all three rows); None/0 for the other families."""
    prompt_token_ids: list[int]
    features: list[MultiModalFeature]
    mrope_positions: Optional[TensorData] = None
    mrope_position_delta: int = 0
