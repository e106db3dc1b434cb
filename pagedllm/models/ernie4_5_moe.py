"""ERNIE 4.5 MoE models (Baidu, 2025, "ERNIE 4.5 Technical Report"; transformers'
``modeling_ernie4_5_moe.py``; ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's dense layer
(``ernie4_5.py``: interleaved RoPE, biases per ``use_bias``) with sparse MoE blocks on the layers
``moe_layer_start_index`` .. ``moe_layer_end_index`` on the ``moe_layer_interval`` grid, each with

- a float32 router: softmax over the experts; the top k chosen on the softmax plus a per-expert
  correction bias (``moe_statics``), weighted by the softmax alone divided by its sum over the k
  (at least ``moe_norm_min``);
- shared experts every token goes through (``moe_num_shared_experts``).

Checkpoint names: ``mlp.gate.weight``, ``mlp.moe_statics.e_score_correction_bias`` [1, E],
``mlp.experts.N.{gate,up,down}_proj``, ``mlp.shared_experts.*``. With ``use_bias`` the LM head has a
bias too (``lm_head.bias``; the dense ERNIE 4.5's has none).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.ernie4_5 import Ernie4_5ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP, PPMissingLayer


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """transformers' ``Ernie4_5_MoeDecoderLayer`` rule."""
    end = getattr(config, "moe_layer_end_index", None)
    end = config.num_hidden_layers - 1 if end is None or end < 0 else end
    return ((layer_idx + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= layer_idx <= end
            and config.moe_num_experts > 0)


class ErnieMoeStatics(nn.Module):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, num_experts, dtype=torch.float32),
                                                    requires_grad=False)


class Ernie4_5_MoeBlock(nn.Module):
    """``gate`` [E, H] float32 + ``moe_statics`` + ``experts`` + ``shared_experts``; one all-reduce."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        e, bias = config.moe_num_experts, bool(getattr(config, "use_bias", False))
        self.top_k, self.norm_min = config.moe_k, float(getattr(config, "moe_norm_min", 1e-12))
        self.gate = nn.Linear(config.hidden_size, e, bias=False, dtype=torch.float32)
        self.gate.weight.requires_grad_(False)
        self.moe_statics = ErnieMoeStatics(e)
        self.experts = FusedMoE(e, self.top_k, config.hidden_size, config.moe_intermediate_size, renormalize=False,
                                dtype=dtype, reduce_results=False)
        self.shared_experts = None
        shared = getattr(config, "moe_num_shared_experts", 0) or 0
        if shared:
            self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * shared, bias=bias,
                                           dtype=dtype, reduce_results=False)  # one all-reduce, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x.float(), self.gate.weight), dim=1, dtype=torch.float)
        ids = torch.topk(probs + self.moe_statics.e_score_correction_bias.squeeze(), self.top_k, dim=-1)[1]
        weights = probs.gather(-1, ids)
        weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)
        out = self.experts.compute(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out)


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        # Expert entries first, or ``experts.N.gate_proj`` would match the dense ``gate_proj`` rule.
        self.stacked_params = FusedMoE.expert_params_mapping("gate_proj", "up_proj", "down_proj",
                                                             config.moe_num_experts) + LlamaForCausalLM.stacked_params
        self.lm_head_bias = None
        if getattr(config, "use_bias", False) and not isinstance(self.lm_head, PPMissingLayer):
            self.lm_head_bias = nn.Parameter(torch.zeros(config.vocab_size, dtype=dtype), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_bias is None:
            return super().compute_logits(hidden)
        logits = self.lm_head.compute_logits(hidden)
        return (logits + self.lm_head_bias[: logits.shape[-1]]).float()

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        return Ernie4_5_MoeBlock(config, dtype) if is_moe_layer(config, layer_idx) else None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights((name.replace("lm_head.bias", "lm_head_bias"), w) for name, w in weights)
