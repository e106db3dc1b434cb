"""Qwen2: the Llama architecture with biases on the q/k/v projections (transformers'
``modeling_qwen2.py``).

Also the language model of Qwen2-VL and Qwen2.5-VL (``models/checkpoint.py`` maps them here; their
vision tower is ``models/qwen2_vl_vision.py``): their text config's RoPE has an ``mrope_section``, and
a step that prefills image tokens passes positions [3, N] (t, h, w: ``layers/mrope.py``), whose
rotary table is gathered per stream. Positions [N] are plain RoPE, as for text alone.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.config import get_rope_parameters
from pagedllm.layers.mrope import mrope_channel_streams, mrope_cos_sin
from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    def __init__(self, config: Any, dtype: torch.dtype, backend=None) -> None:
        super().__init__(config, dtype, backend)
        section = get_rope_parameters(config).get("mrope_section")
        # [R] int64: the stream (t, h, w) of each rotary channel under M-RoPE (None: no M-RoPE)
        self.register_buffer("mrope_streams", mrope_channel_streams(section, self.rotary_emb.rotary_dim)
                             if section else None, persistent=False)

    def rope_tables(self, positions: torch.Tensor) -> Any:
        """[N, 2, 1, R] for positions [N], or [3, N] (M-RoPE: each channel at its stream's position)."""
        if positions.dim() == 2:
            if self.mrope_streams is None:
                raise ValueError(f"positions {tuple(positions.shape)} (M-RoPE) given to a model without mrope_section")
            return mrope_cos_sin(self.rotary_emb, positions, self.mrope_streams)
        return super().rope_tables(positions)
