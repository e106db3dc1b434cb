"""OLMo 3 (Team OLMo, 2025, "Olmo 3"; transformers' ``modeling_olmo3.py``): OLMo 2's layer
(``olmo2.py``: norms after each branch and over the whole q and k projections) with

- sliding-window attention on the layers ``config.layer_types`` calls sliding (by default 3 of
  every 4, window ``sliding_window`` = 4096), global attention on the others;
- RoPE settings per layer type (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``);
  a long-context checkpoint scales only the global layers' (YaRN).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.config import get_rope_parameters
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import PPMissingLayer
from pagedllm.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    sliding_window_by_default = True  # no use_sliding_window flag: layer_types says which layers slide

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)  # every layer on the global layers' RoPE (self.rotary_emb)
        sliding = get_rope_parameters(config, "sliding_attention")
        self.sliding_rotary_emb = self.rotary_emb
        if sliding != get_rope_parameters(config, "full_attention"):
            r = self.rotary_emb
            self.sliding_rotary_emb = RotaryEmbedding(r.head_dim, config.max_position_embeddings, sliding,
                                                      r.cos_sin_cache.dtype)
        for layer, window in zip(self.layers, self.layer_windows(config)):
            if window and not isinstance(layer, PPMissingLayer):
                layer.self_attn.rotary_emb = self.sliding_rotary_emb

    def rotary_embs(self) -> list:
        return list({id(r): r for r in (self.rotary_emb, self.sliding_rotary_emb)}.values())

    def rope_tables(self, positions: torch.Tensor) -> Any:
        if self.sliding_rotary_emb is self.rotary_emb:
            return super().rope_tables(positions)
        return {id(r): r.cos_sin(positions) for r in self.rotary_embs()}
