"""EXAONE 4.0 (LG AI Research, 2025, "EXAONE 4.0: Unified Large Language Models Integrating
Non-reasoning and Reasoning Modes"; transformers' ``modeling_exaone4.py``): OLMo 2's layer
(``olmo2.py``: each branch's output normed before its residual add, no pre-norms) with Qwen3's
per-head q/k RMSNorms, and, where the config sets a ``sliding_window``, hybrid attention: layers
typed ``sliding_attention`` (``config.layer_types``; by default 3 of every 4) attend within the
window with RoPE, the others attend globally without RoPE (NoPE, as ``smollm3.NoPELayers``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.attention.backend import SlidingWindowBackend
from pagedllm.models.llama import LlamaForCausalLM, PPMissingLayer
from pagedllm.models.olmo2 import Olmo2DecoderLayer
from pagedllm.models.smollm3 import NoPELayers


def sliding_layers(config: Any) -> list[bool]:
    """Whether each layer slides: none without ``sliding_window``, else ``layer_types``."""
    if not getattr(config, "sliding_window", None):
        return [False] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [t == "sliding_attention" for t in types]


class Exaone4ForCausalLM(NoPELayers, LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
    qk_norm = True  # per head (Olmo2DecoderLayer then builds LlamaAttention with q/k norms)

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        slides = sliding_layers(config)
        for layer, slide in zip(self.layers, slides):
            if slide and not isinstance(layer, PPMissingLayer):
                layer.self_attn.backend = SlidingWindowBackend(layer.self_attn.backend, config.sliding_window)
        hybrid = bool(getattr(config, "sliding_window", None))
        self.set_nope([slide or not hybrid for slide in slides])  # hybrid models: global layers NoPE

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """As Llama's; ``layer_types`` must give one type per layer."""
        super().verify_config(config, max_model_len)
        if len(sliding_layers(config)) != config.num_hidden_layers:
            raise ValueError(f"{cls.__name__}: layer_types has {len(sliding_layers(config))} entries for "
                             f"{config.num_hidden_layers} layers")
