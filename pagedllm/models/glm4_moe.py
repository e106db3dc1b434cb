"""GLM-4.5 / 4.6 / 4.7 (Zhipu AI, 2025, "GLM-4.5: Agentic, Reasoning, and Coding (ARC) Foundation
Models"; transformers' ``modeling_glm4_moe.py``): Llama-style pre-norm blocks with

- grouped-query attention with q/k/v biases (none on the output projection), RoPE on the first half
  of each head (``partial_rotary_factor`` 0.5, halves layout), optional per-head q/k RMSNorm before
  it (``use_qk_norm``);
- dense SwiGLU MLPs on the first ``first_k_dense_replace`` layers, then MoE blocks: DeepSeek-V3's
  router (Liu et al., 2024, "DeepSeek-V3 Technical Report": sigmoid scores, a per-expert correction
  bias used only to choose, the experts chosen within the ``topk_group`` best of ``n_group`` groups,
  the chosen scores renormalized when ``norm_topk_prob`` and scaled by ``routed_scaling_factor``),
  plus shared experts every token goes through.

Checkpoint names: ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias`` (the router, kept in
float32 as transformers keeps it), ``mlp.experts.N.{gate,up,down}_proj``, ``mlp.shared_experts.*``.
The multi-token-prediction layer GLM-4.5 checkpoints carry (index ``num_hidden_layers``) is loaded apart, by
speculative decoding's ``mtp`` method (``models/mtp.py``).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.models.mtp import skip_mtp_layers


def grouped_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int, topk_group: int,
                 renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing in transformers' operations (``DeepseekV3TopkRouter``).

    Args:
        logits: [N, E] float32 router logits.
        correction_bias: [E] float32, added to the scores to choose experts only.
    Returns:
        (weights [N, top_k] float32, expert ids [N, top_k] int64).
    """
    scores = logits.sigmoid()
    choice = scores + correction_bias
    n, e = choice.shape
    group_scores = choice.view(n, num_groups, e // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, num_groups, e // num_groups).reshape(n, e)
    ids = torch.topk(choice.masked_fill(~score_mask.bool(), float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class Glm4MoeRouter(nn.Module):
    """``weight`` [E, hidden] and (``correction_bias``) ``e_score_correction_bias`` [E], float32 whatever
    the model's dtype. forward: [N, hidden] -> float32 logits [N, E]."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class SharedExpertsMoeBlock(nn.Module):
    """DeepSeek-style MoE block: ``gate`` (a subclass's router) + routed ``experts`` + ``shared_experts``,
    one all-reduce. [N, H] -> [N, H]. Subclasses set ``gate`` and implement ``route``."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.scaling = config.num_experts_per_tok, float(config.routed_scaling_factor)
        self.experts = FusedMoE(config.n_routed_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                renormalize=False, dtype=dtype, reduce_results=False)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                           bias=False, dtype=dtype, reduce_results=False)  # one all-reduce, after

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, top_k] float32, expert ids [N, top_k] int64)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts.compute(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out)


class Glm4MoeBlock(SharedExpertsMoeBlock):
    """DeepSeek-V3's sigmoid router (``grouped_topk``) over the shared-experts block."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        num_experts, num_groups, topk_group = config.n_routed_experts, config.n_group, config.topk_group
        if num_experts % num_groups or num_experts // num_groups < 2 or not 0 < topk_group <= num_groups:
            raise ValueError(f"n_routed_experts={num_experts} must split into n_group={num_groups} groups of at "
                             f"least 2 experts (a group scores by its best two), of which topk_group="
                             f"{topk_group} are kept")
        super().__init__(config, dtype)
        self.num_groups, self.topk_group = num_groups, topk_group
        self.renormalize = bool(config.norm_topk_prob)
        self.gate = Glm4MoeRouter(config.hidden_size, num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.num_groups,
                            self.topk_group, self.renormalize, self.scaling)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    mtp_layout = "deepseek"  # its MTP layer at model.layers.{num_hidden_layers} (models/mtp.py)

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        if not hasattr(config, "attention_out_bias"):
            config.attention_out_bias = False  # q/k/v have biases (attention_bias); o_proj never
        super().__init__(config, dtype, backend)
        # Expert entries first, or ``experts.N.gate_proj`` would match the dense ``gate_proj`` rule.
        self.stacked_params = FusedMoE.expert_params_mapping("gate_proj", "up_proj", "down_proj",
                                                             config.n_routed_experts) + LlamaForCausalLM.stacked_params

    @property
    def qk_norm(self) -> bool:
        return bool(getattr(self.config, "use_qk_norm", False))

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        return None if layer_idx < config.first_k_dense_replace else Glm4MoeBlock(config, dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        # (the multi-token-prediction layer goes to spec_decode's MTP proposer, not here: models/mtp.py)
        return super().load_weights(skip_mtp_layers(weights, self.config.num_hidden_layers))
