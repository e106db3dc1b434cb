"""StarCoder2 (Lozhkov et al., 2024, "StarCoder 2 and The Stack v2"; transformers'
``modeling_starcoder2.py``): the Llama block layout with LayerNorms (weight and bias) in place of
RMSNorms, a plain GELU-tanh MLP (``c_fc``, ``c_proj``) in place of SwiGLU, biases on every linear
(``use_bias``) and a sliding window on every layer (``sliding_window``, as Mistral's).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, PPMissingLayer


class Starcoder2MLP(nn.Module):
    """c_proj(act(c_fc(x))), act GELU-tanh in StarCoder2's configs."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, dtype) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(hidden, intermediate, bias=bias, dtype=dtype)
        self.c_proj = RowParallelLinear(intermediate, hidden, bias=bias, dtype=dtype)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward_fused) over LayerNorms and the plain MLP."""

    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None, rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, dtype, backend, qkv_bias, False, rotary_emb)
        self.mlp = mlp if mlp is not None else Starcoder2MLP(config.hidden_size, config.intermediate_size,
                                                             config.hidden_act, config.use_bias, dtype)
        self.input_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon, dtype)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Starcoder2DecoderLayer
    sliding_window_by_default = True  # no use_sliding_window flag: the window applies when set

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        config = copy.copy(config)  # what Llama's blocks read: attention_bias (q/k/v and o), rms_norm_eps
        config.attention_bias, config.rms_norm_eps = config.use_bias, config.norm_epsilon
        super().__init__(config, dtype, backend)
        if not isinstance(self.norm, PPMissingLayer):
            self.norm = LayerNorm(config.hidden_size, config.norm_epsilon, dtype)
