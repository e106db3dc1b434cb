"""Qwen2-MoE (transformers' ``modeling_qwen2_moe.py``): Qwen2 attention (q/k/v biases, per
``qkv_bias``) with sparse MoE blocks: softmax top-k routing (renormalized only when
``norm_topk_prob``) plus a shared expert every token goes through, scaled by a sigmoid gate.
Layers listed in ``mlp_only_layers``, or not on the ``decoder_sparse_step`` grid, stay dense.

Checkpoint names: ``mlp.gate``, ``mlp.experts.N.{gate,up,down}_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``; experts are stacked at load (see ``layers/fused_moe.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.fused_moe import FusedMoE, SparseMoeBlock
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has an MoE block (transformers' Qwen2/Qwen3-MoE decoder rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        # Expert entries first, or ``experts.N.gate_proj`` would match the dense ``gate_proj`` rule.
        self.stacked_params = FusedMoE.expert_params_mapping("gate_proj", "up_proj", "down_proj",
                                                             config.num_experts) + LlamaForCausalLM.stacked_params

    @property
    def qkv_bias(self) -> bool:
        return getattr(self.config, "qkv_bias", True)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        if not is_sparse_layer(config, layer_idx):
            return None
        shared, shared_size = None, getattr(config, "shared_expert_intermediate_size", 0)
        if shared_size:
            # the MoE block all-reduces once, after the combine
            shared = LlamaMLP(config.hidden_size, shared_size, bias=False, dtype=dtype, reduce_results=False)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob), dtype=dtype,
                              shared_expert=shared, shared_expert_gate=shared is not None)
