"""HunYuan dense models (Tencent, 2025; transformers' ``modeling_hunyuan_v1_dense.py``;
Hunyuan-0.5B/1.8B/4B/7B-Instruct): Llama's decoder with

- an RMSNorm over each query and key head *after* RoPE (``query_layernorm``, ``key_layernorm``;
  Qwen3's come before it);
- NTK-alpha RoPE (``rope_type`` "dynamic" with an ``alpha``): a fixed base
  theta * alpha ** (d / (d - 2)), whatever the sequence length (transformers'
  ``compute_ntk_alpha_rope_parameters``).
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch

from pagedllm.config import get_rope_parameters
from pagedllm.layers.attention import AttentionBackend
from pagedllm.models.llama import LlamaForCausalLM, PPMissingLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        rope = get_rope_parameters(config)
        if rope["rope_type"] == "dynamic" and rope.get("alpha"):
            d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            config = copy.copy(config)  # the same base, computed as transformers does, on the default RoPE
            config.rope_parameters = {"rope_type": "default",
                                      "rope_theta": rope["rope_theta"] * rope["alpha"] ** (d / (d - 2))}
            if "rope_scaling" in vars(config):  # transformers 4.x keeps it apart
                config.rope_scaling = None
        super().__init__(config, dtype, backend)
        for layer in self.layers:
            if not isinstance(layer, PPMissingLayer):
                layer.self_attn.qk_norm_after_rope = True

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights((name.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm."), w)
                                    for name, w in weights)
