"""OLMo 2 (Team OLMo, 2024, "2 OLMo 2 Furious"; transformers' ``modeling_olmo2.py``): the Llama
blocks with the norms moved after each branch and onto q and k:

- no norm before attention or the MLP; each branch's output is RMSNorm-ed before its residual add
  (``post_attention_layernorm``, ``post_feedforward_layernorm``);
- an RMSNorm over the whole query projection and over the whole key projection (all heads at once,
  not per head as Qwen3's), before RoPE.

The whole-projection norms need all heads on one rank, so tensor parallelism is refused.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_size
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, plain_layout
from pagedllm.platforms.layout import DecoderLayout, norm_paths


class Olmo2Attention(LlamaAttention):
    """LlamaAttention with q_norm [num_heads * head_dim] and k_norm [num_kv_heads * head_dim] over
    the projections before they split into heads."""

    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool,
                 rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__(config, dtype, backend, qkv_bias, False, rotary_emb)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, cos_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.split_heads(self.qkv_proj(x))
        # each token's q (k) as one row over all heads; in place through the CPU kernel where it
        # applies (the one the layer runner calls), else a new tensor
        q = self.q_norm.forward_heads_(q.view(n, 1, -1)).view(n, self.num_heads, self.head_dim)
        k = self.k_norm.forward_heads_(k.view(n, 1, -1)).view(n, self.num_kv_heads, self.head_dim)
        if cos_sin is None:
            cos_sin = self.rotary_emb.cos_sin(positions)
        q, k = self.rotary_emb(positions, q, k, cos_sin=cos_sin)  # in place
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, -1))


class Olmo2DecoderLayer(nn.Module):
    """x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(x)).
    ``qk_norm``: per-head q/k norms in LlamaAttention (EXAONE 4) instead of OLMo 2's whole-projection ones."""

    # What the block is made of (platforms/layout.py): no norm before a branch, each branch's output
    # RMSNorm-ed before its residual add; q/k norms over all heads (per head: EXAONE 4); a SwiGLU MLP.
    layout = DecoderLayout("post_norm", norm_paths({"post": "post_attention_layernorm", "q": "self_attn.q_norm",
                                                    "k": "self_attn.k_norm", "post_ff": "post_feedforward_layernorm"}))

    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None, rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__()
        self.self_attn = (LlamaAttention(config, dtype, backend, qkv_bias, True, rotary_emb) if qk_norm
                          else Olmo2Attention(config, dtype, backend, qkv_bias, rotary_emb))
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size,
                                                        getattr(config, "mlp_bias", False), dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                      kv_cache, meta, cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward_fused: (the normed MLP output, the residual stream), whose
        sum is the block's output; the stream is updated in place."""
        stream = x if residual is None else residual.add_(x)
        stream.add_(self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, meta, cos_sin)))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream

    def decoder_layout(self) -> tuple[Optional[DecoderLayout], str]:
        """(``layout``, "") for the plain block (``llama.plain_layout``), its q/k norms over all heads
        with Olmo2Attention, per head with LlamaAttention; else (None, why not)."""
        whole = type(self.self_attn).forward is Olmo2Attention.forward
        return plain_layout(self, self.layout.replace(qk_norm="whole") if whole else self.layout, "forward_fused",
                            Olmo2DecoderLayer.forward_fused, (LlamaAttention.forward, Olmo2Attention.forward),
                            LlamaMLP.forward, "SwiGLU", RMSNorm)


def refuse_tensor_parallel(model_cls: type) -> None:
    """Raise ValueError under tensor parallelism: OLMo 2's whole-projection q/k norms need every head
    on one rank (models with them also set ``supports_tp = False``, checked before any process starts)."""
    if get_tp_size() > 1:
        raise ValueError(f"tensor parallelism is not implemented for {model_cls.__name__} (its q/k norms span all "
                         f"heads); use --tensor-parallel-size 1 (or --pipeline-parallel-size)")


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
    supports_tp = False  # the q/k norms span all heads (checked before any process starts)

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        refuse_tensor_parallel(Olmo2ForCausalLM)
        super().__init__(config, dtype, backend)
