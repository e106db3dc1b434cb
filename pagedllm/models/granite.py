"""IBM Granite 3.x dense models (transformers' ``modeling_granite.py``): the Llama architecture
with four scalars from the config (μP-style):

- ``embedding_multiplier``: the token embeddings are multiplied by it;
- ``attention_multiplier``: the attention scale (in place of head_dim ** -0.5);
- ``residual_multiplier``: each attention and MLP output is multiplied by it before its residual add;
- ``logits_scaling``: the logits are divided by it.

Each product is the one transformers computes (a tensor times a Python float, in the model's
dtype), so float32 results stay bit-equal to it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer with the config's ``residual_multiplier`` (its forward_fused scales the
    attention and MLP outputs before their residual adds) and ``attention_multiplier`` as the
    attention scale."""

    def __init__(self, config: Any, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = float(config.residual_multiplier)
        self.self_attn.scale = float(config.attention_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GraniteDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head.compute_logits(hidden) / self.logits_scaling).float()
