"""Qwen2: the Llama architecture with biases on the q/k/v projections (transformers'
``modeling_qwen2.py``)."""
from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
