"""SmolLM3 (Hugging Face, 2025, "SmolLM3: smol, multilingual, long-context reasoner";
transformers' ``modeling_smollm3.py``): the Llama architecture with NoPE layers: a layer whose
``config.no_rope_layers`` entry is 0 applies no rotary embedding (by default every 4th layer).

A NoPE layer takes an identity table (cos 1, sin 0), which leaves q and k exactly as they are
(x * 1 + rot(x) * 0 == x), so the layer loop and the CPU layer runner keep their one code path
(``NoPELayers``, which EXAONE 4's global layers use too).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaForCausalLM, PPMissingLayer


def rope_layers(config: Any) -> list[bool]:
    """Whether each layer rotates: ``no_rope_layers`` (1: RoPE, 0: NoPE), else every
    ``no_rope_layer_interval``-th layer NoPE (transformers' default)."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        every = getattr(config, "no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(config.num_hidden_layers)]
    return [bool(f) for f in flags]


class NoPELayers:
    """For a LlamaForCausalLM subclass: ``set_nope(rotates)`` gives each layer whose flag is False
    the identity table, which ``rope_tables`` hands the layers (and the runner) beside the RoPE one."""

    def set_nope(self, rotates: list[bool]) -> None:
        r = self.rotary_emb
        self.no_rope_emb = RotaryEmbedding(r.head_dim, 1, {}, r.cos_sin_cache.dtype,
                                           inv_freq=torch.zeros(r.rotary_dim // 2))
        for layer, rot in zip(self.layers, rotates):
            if not rot and not isinstance(layer, PPMissingLayer):
                layer.self_attn.rotary_emb = self.no_rope_emb

    def rotary_embs(self) -> list:
        return [self.rotary_emb, self.no_rope_emb]

    def rope_tables(self, positions: torch.Tensor) -> dict:
        identity = self.no_rope_emb.cos_sin(torch.zeros_like(positions))  # its one row, N times
        return {id(self.rotary_emb): self.rotary_emb.cos_sin(positions), id(self.no_rope_emb): identity}


class SmolLM3ForCausalLM(NoPELayers, LlamaForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        self.set_nope(rope_layers(config))

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """As Llama's; ``no_rope_layers`` must give one flag per layer."""
        super().verify_config(config, max_model_len)
        if len(rope_layers(config)) != config.num_hidden_layers:
            raise ValueError(f"SmolLM3ForCausalLM: no_rope_layers has {len(rope_layers(config))} entries for "
                             f"{config.num_hidden_layers} layers")
