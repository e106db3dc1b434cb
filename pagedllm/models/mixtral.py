"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"; transformers' ``modeling_mixtral.py``): the
Llama/Mistral blocks with every MLP replaced by a sparse MoE block, top-k routing renormalized over
the chosen experts (see ``layers/fused_moe.py``).

Checkpoint names: ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.N.w1/w3/w2``
(gate/up/down of expert N), stacked at load into ``mlp.experts.w13`` / ``mlp.experts.w2``.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.fused_moe import FusedMoE, SparseMoeBlock
from pagedllm.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    # transformers applies ``sliding_window`` whenever it is set (Mixtral has no use_sliding_window flag).
    sliding_window_by_default = True

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        # Expert entries first: ``experts.N.w1`` must not fall through to another rule.
        self.stacked_params = FusedMoE.expert_params_mapping("w1", "w3", "w2", config.num_local_experts) \
            + LlamaForCausalLM.stacked_params

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> SparseMoeBlock:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, dtype=dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), w) for name, w in weights)
