"""Cohere's Command R / Aya Expanse (``CohereForCausalLM``) and Command R7B / Command A
(``Cohere2ForCausalLM``) (transformers' ``modeling_cohere.py``, ``modeling_cohere2.py``):

- a parallel block: one LayerNorm (weight only) feeds both branches, x + attn(ln(x)) + mlp(ln(x));
- interleaved RoPE (channel pairs 2i, 2i + 1), loaded as Llama's rotate-half layout by permuting each
  head's q/k rows (``ernie4_5.interleaved_to_half``: a permutation of both leaves every score);
- the logits multiplied by ``logit_scale``, the embeddings tied;
- Cohere 2: 3 sliding-window layers (RoPE) per global one without RoPE (``layer_types``).

The per-head q/k LayerNorms of Command R+ (``use_qk_norm``) are not implemented.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.ernie4_5 import interleaved_qk_to_half
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, PPMissingLayer
from pagedllm.models.smollm3 import NoPELayers


class CohereDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None, rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, dtype, backend, qkv_bias, False, rotary_emb)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size, False, dtype)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype, bias=False)

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                      kv_cache, meta, cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, stream + attention output): their sum is the block's output, added in
        transformers' order, (x + attn) + mlp."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(positions, h, kv_cache, meta, cos_sin)
        return self.mlp(h), residual.add_(a)


class CohereForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = CohereDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        config = copy.copy(config)  # what Llama's model reads for its final norm, replaced below
        config.rms_norm_eps = config.layer_norm_eps
        super().__init__(config, dtype, backend)
        if not isinstance(self.norm, PPMissingLayer):
            self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype, bias=False)
        self.logit_scale = float(getattr(config, "logit_scale", 1.0))

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """As Llama's; Command R+'s per-head q/k norms are refused."""
        super().verify_config(config, max_model_len)
        if getattr(config, "use_qk_norm", False):
            raise ValueError(f"{cls.__name__} with use_qk_norm=True (Command R+) is not supported")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(interleaved_qk_to_half(weights, self.rotary_emb))


class Cohere2ForCausalLM(NoPELayers, CohereForCausalLM):
    sliding_window_by_default = True  # layer_types says which layers slide

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        self.set_nope([window is not None for window in self.layer_windows(config)])  # global layers: NoPE
