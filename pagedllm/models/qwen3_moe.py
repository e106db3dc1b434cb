"""Qwen3-MoE (transformers' ``modeling_qwen3_moe.py``): Qwen3 attention (RMSNorm on each query and
key head, biases per ``attention_bias``) with the Qwen2-MoE sparse blocks minus the shared expert."""
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qkv_bias = False
    qk_norm = True
