"""Gemma 3 text models (Gemma Team, 2025, "Gemma 3 Technical Report"; transformers'
``modeling_gemma3.py``, ``Gemma3ForCausalLM``): the Gemma 2 decoder (``gemma2.py``) with an RMSNorm
over each query and key head before RoPE, a RoPE base (and scaling) per layer type — local
(sliding) layers use ``rope_local_base_freq``, global layers ``rope_theta`` — and, by default, 5
sliding layers per global one and no soft-capping (the config says which).
"""
from __future__ import annotations

from typing import Any

from pagedllm.config import get_rope_parameters
from pagedllm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM


class Gemma3Attention(Gemma2Attention):
    qk_norm = True


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer
    sliding_window_pattern = 6

    @staticmethod
    def rope_for(config: Any, layer_type: str) -> dict:
        params = getattr(config, "rope_parameters", None) or {}
        if layer_type in params or layer_type != "sliding_attention":  # transformers 5: one dict per layer type
            return get_rope_parameters(config, layer_type)
        # transformers 4.x: local layers take rope_local_base_freq unscaled
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
