"""Ministral 3 (Mistral AI, 2025; transformers' ``modeling_ministral3.py``; the language model of
the Ministral 3 3B/8B/14B image-text checkpoints): Mistral's decoder (``llama.py``) with YaRN RoPE
and Llama 4's attention temperature: past ``original_max_position_embeddings`` L, the rotated query
at position p is multiplied by 1 + beta * log(1 + floor(p / L)) (``llama_4_scaling_beta``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.config import get_rope_parameters
from pagedllm.layers.attention import AttentionBackend
from pagedllm.models.llama import MistralForCausalLM, PPMissingLayer


class Ministral3ForCausalLM(MistralForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None,
                 max_model_len: Optional[int] = None) -> None:
        super().__init__(config, dtype, backend)
        rope = get_rope_parameters(config)
        beta, original = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        # Below position L every factor is exactly 1: only a longer max_model_len needs the scaling.
        if beta and original and (max_model_len or config.max_position_embeddings) > original:
            for layer in self.layers:
                if not isinstance(layer, PPMissingLayer):
                    layer.self_attn.query_scale = (float(beta), int(original))
