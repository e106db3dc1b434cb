"""Gemma (Gemma Team, 2024, "Gemma: Open Models Based on Gemini Research and Technology";
transformers' ``modeling_gemma.py``): Gemma 2's decoder (``gemma2.py``) as it was before, two
RMSNorms a layer (before attention and before the MLP, Llama's places), every layer global, no
soft-capping, attention scale head_dim ** -0.5; kept from Gemma: x * (1 + weight) norms, token
embeddings scaled by sqrt(hidden_size) rounded to the model dtype, the GELU-tanh gated MLP and tied
embeddings. CodeGemma is this architecture too.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaMLP, gemma_layout
from pagedllm.platforms.layout import DecoderLayout


class GemmaDecoderLayer(Gemma2DecoderLayer):
    """Pre-norm block: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x))."""

    # Gemma 2's layout (platforms/layout.py) with two of its norm slots: post_attention_layernorm is the
    # norm before the MLP; none after attention or the MLP (a plain add).
    layout = Gemma2DecoderLayer.layout.replace(norms={"post": None, "pre_ff": "post_attention_layernorm",
                                                      "post_ff": None})

    def __init__(self, config: Any, layer_type: str, rotary: RotaryEmbedding, dtype, backend: AttentionBackend) -> None:
        nn.Module.__init__(self)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma2Attention(config, layer_type, rotary, dtype, backend)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
        self.mlp = GemmaMLP(h, config.intermediate_size, act, dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions, x, kv_cache, meta, cos_sin=None):
        """x [N, hidden]: the residual stream, updated in place and returned."""
        o = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, cos_sin)
        h = self.post_attention_layernorm(x.add_(o))
        return x.add_(self.mlp(h))

    def decoder_layout(self) -> tuple[Optional[DecoderLayout], str]:
        return gemma_layout(self, GemmaDecoderLayer.forward)


class GemmaForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = GemmaDecoderLayer
    sliding_window_pattern = 1  # every layer global (layer_types: (i + 1) % 1 == 0)
