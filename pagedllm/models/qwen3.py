"""Qwen3: the Llama architecture with an RMSNorm over each query and key head before RoPE
(transformers' ``modeling_qwen3.py``)."""
from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
