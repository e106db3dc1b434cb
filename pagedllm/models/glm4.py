"""GLM-4 (Team GLM, 2024, "ChatGLM: A Family of Large Language Models from GLM-130B to GLM-4 All
Tools"; transformers' ``modeling_glm.py`` for GLM-4-9B-Chat as ``GlmForCausalLM`` and
``modeling_glm4.py`` for GLM-4-0414 / GLM-Z1 as ``Glm4ForCausalLM``): Llama's decoder with

- RoPE on the first ``partial_rotary_factor`` (0.5) of each head's channels, interleaved: pairs
  (2i, 2i + 1) rotate together. As for ERNIE 4.5 (``ernie4_5.py``), the loader permutes those
  channels of each head's q and k rows into Llama's rotate-half layout, which leaves every score as
  it is;
- biases on q, k and v (``attention_bias``) but none on o_proj or the MLP, whose gate and up
  projections come fused in one checkpoint tensor (``gate_up_proj``, split as Phi-3's);
- GLM-4-0414: each branch's output RMSNorm-ed before its residual add as well
  (``post_self_attn_layernorm``, ``post_mlp_layernorm``; Gemma 2's sandwich with plain RMSNorms).
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.models.ernie4_5 import interleaved_qk_to_half
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.phi3 import split_fused


class Glm4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, dtype, backend, qkv_bias: bool, qk_norm: bool,
                 mlp=None, rotary_emb=None) -> None:
        super().__init__(config, dtype, backend, qkv_bias, qk_norm, mlp, rotary_emb)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                      kv_cache, meta, cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward_fused, each branch's output normed before it joins the stream."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(positions, x, kv_cache, meta, cos_sin))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class GlmForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        plain = copy.copy(config)  # attention_bias covers q/k/v only; the MLP has no biases
        plain.attention_out_bias, plain.mlp_bias = False, False
        super().__init__(plain, dtype, backend)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(interleaved_qk_to_half(split_fused(self.config, weights), self.rotary_emb))


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer_cls = Glm4DecoderLayer
