"""OLMoE (Muennighoff et al., 2024, "OLMoE: Open Mixture-of-Experts Language Models"; transformers'
``modeling_olmoe.py``): Llama's pre-norm blocks with

- OLMo 2's RMSNorm over the whole query and the whole key projection (``olmo2.Olmo2Attention``),
  and, when ``clip_qkv`` is set, q, k and v clamped to [-clip_qkv, clip_qkv] after those norms;
- a sparse MoE block on every layer: softmax over the experts, the top ``num_experts_per_tok``,
  renormalized only when ``norm_topk_prob``; no shared expert (``layers/fused_moe.py``).

Checkpoint names are Qwen2-MoE's: ``mlp.gate`` and ``mlp.experts.N.{gate,up,down}_proj``. The
whole-projection norms need all heads on one rank, so tensor parallelism is refused.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.fused_moe import FusedMoE, SparseMoeBlock
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.olmo2 import Olmo2Attention, refuse_tensor_parallel


class OlmoeAttention(Olmo2Attention):
    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 rotary_emb=None) -> None:
        super().__init__(config, dtype, backend, qkv_bias, rotary_emb)
        clip = getattr(config, "clip_qkv", None)
        self.clip_qkv = float(clip) if clip is not None else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, cos_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.clip_qkv is None:
            return super().forward(positions, x, kv_cache, meta, cos_sin)
        n = x.shape[0]
        q, k, v = self.qkv_proj.split_heads(self.qkv_proj(x))
        q = self.q_norm(q.reshape(n, -1)).clamp_(-self.clip_qkv, self.clip_qkv).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(n, -1)).clamp_(-self.clip_qkv, self.clip_qkv).view(n, self.num_kv_heads,
                                                                                    self.head_dim)
        v = v.clamp(-self.clip_qkv, self.clip_qkv)
        q, k = self.rotary_emb(positions, q, k, cos_sin=cos_sin if cos_sin is not None
                               else self.rotary_emb.cos_sin(positions))
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, -1))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention


class OlmoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = OlmoeDecoderLayer
    supports_tp = False  # the q/k norms span all heads (checked before any process starts)

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        refuse_tensor_parallel(OlmoeForCausalLM)
        super().__init__(config, dtype, backend)
        # Expert entries first, or ``experts.N.gate_proj`` would match the dense ``gate_proj`` rule.
        self.stacked_params = FusedMoE.expert_params_mapping("gate_proj", "up_proj", "down_proj",
                                                             config.num_experts) + LlamaForCausalLM.stacked_params

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> SparseMoeBlock:
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              dtype=dtype)
