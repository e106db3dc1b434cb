"""Phi-1, Phi-1.5 and Phi-2 (Microsoft, 2023, "Textbooks Are All You Need"; transformers'
``modeling_phi.py``): a parallel block, (attn(ln(x)) + mlp(ln(x))) + x, over LayerNorms with biases;
RoPE on the first ``partial_rotary_factor`` (0.4 or 0.5) of each head's channels; biases on every
linear, the LM head's included; a plain GELU-tanh MLP (``fc1``, ``fc2``).

The q/k LayerNorms of ``qk_layernorm`` (no released checkpoint sets it) are not implemented.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, PPMissingLayer
from pagedllm.models.starcoder2 import Starcoder2MLP

# checkpoint name fragment -> ours (Llama's layout, StarCoder2's MLP)
_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."),
            ("model.final_layernorm.", "model.norm."), ("lm_head.bias", "lm_head_bias"))


class PhiDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None, rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, dtype, backend, True, False, rotary_emb)
        self.mlp = mlp if mlp is not None else Starcoder2MLP(config.hidden_size, config.intermediate_size,
                                                             config.hidden_act, True, dtype)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                      kv_cache, meta, cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(attn + mlp, the stream): the next add makes transformers' (attn + mlp) + x."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.self_attn(positions, h, kv_cache, meta, cos_sin).add_(self.mlp(h)), residual


class PhiForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = PhiDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        config = copy.copy(config)  # what Llama's blocks read: o_proj's bias, the final norm's epsilon
        config.attention_bias, config.rms_norm_eps = True, config.layer_norm_eps
        super().__init__(config, dtype, backend)
        if not isinstance(self.norm, PPMissingLayer):
            self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
            self.lm_head_bias = nn.Parameter(torch.zeros(config.vocab_size, dtype=dtype), requires_grad=False)

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """As Llama's; ``qk_layernorm`` is refused."""
        super().verify_config(config, max_model_len)
        if getattr(config, "qk_layernorm", False):
            raise ValueError("PhiForCausalLM with qk_layernorm=True is not supported")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        return (logits + self.lm_head_bias[: logits.shape[-1]]).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        def renamed():
            for name, w in weights:
                for old, new in _RENAMES:
                    name = name.replace(old, new)
                yield name, w
        return super().load_weights(renamed())
