"""Phi-3 (Abdin et al., 2024, "Phi-3 Technical Report"): the Llama architecture with q/k/v and
gate/up fused in the checkpoint (``qkv_proj``, ``gate_up_proj``), LongRoPE scaling for the
long-context variants and partial rotary embeddings (transformers' ``modeling_phi3.py``).

The fused checkpoint tensors are split back into q/k/v and gate/up on load, so each rank reads its
own heads of each (``layers/linear.py`` shards by part). The rotary embedding comes from
``layers/rotary_longrope.py`` (which factors, and why, is explained there).
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Optional

import torch

from pagedllm.config import get_rope_parameters
from pagedllm.layers.attention import AttentionBackend, TorchPagedAttention
from pagedllm.layers.attention.backend import SlidingWindowBackend
from pagedllm.layers.linear import load_narrow, loaded_shape
from pagedllm.layers.rotary_longrope import get_phi3_rope
from pagedllm.models.llama import LlamaForCausalLM, PPMissingLayer


def split_fused(c: Any, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors of fused projections, split as Llama's loader names them: qkv_proj ->
    q_proj, k_proj, v_proj and gate_up_proj -> gate_proj, up_proj (row blocks; Phi-3's, GLM's MLP)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    num_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    q_size, kv_size = c.num_attention_heads * head_dim, num_kv * head_dim
    for name, w in weights:
        if ".qkv_proj." in name:
            parts = [("q_proj", 0, q_size), ("k_proj", q_size, kv_size), ("v_proj", q_size + kv_size, kv_size)]
        elif ".gate_up_proj." in name:
            half = loaded_shape(w)[0] // 2
            parts = [("gate_proj", 0, half), ("up_proj", half, half)]
        else:
            yield name, w
            continue
        fused = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
        expected = q_size + 2 * kv_size if fused == "qkv_proj" else 2 * c.intermediate_size
        if loaded_shape(w)[0] != expected:
            raise ValueError(f"{name}: expected {expected} rows, got {loaded_shape(w)[0]}")
        for part, start, size in parts:
            yield name.replace(fused, part), load_narrow(w, 0, start, size)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Every layer attends within ``config.sliding_window`` when the config sets one (Phi-3-mini-4k:
    2047), as transformers' Phi-3 does."""

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None,
                 max_model_len: Optional[int] = None) -> None:
        rope = get_rope_parameters(config)
        if "original_max_position_embeddings" not in rope and hasattr(config, "original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = config.original_max_position_embeddings  # transformers 4.x
        # The Llama blocks are built with a placeholder RoPE (one position: nothing large is
        # allocated), then every layer shares one Phi-3 rotary embedding.
        plain = copy.copy(config)
        plain.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        if "rope_scaling" in vars(plain):  # transformers 4.x keeps it apart (5.x: an alias of the above)
            plain.rope_scaling = None
        plain.max_position_embeddings = 1
        backend = backend or TorchPagedAttention()
        window = getattr(config, "sliding_window", None)
        super().__init__(plain, dtype, SlidingWindowBackend(backend, window) if window else backend)
        self.config = config
        attn = self.layers[self.start_layer].self_attn  # (the first layer of this pipeline stage)
        rotary = get_phi3_rope(attn.head_dim, config.max_position_embeddings, rope, dtype,
                               max_model_len or config.max_position_embeddings)
        self.rotary_emb = rotary
        for layer in self.layers:
            if not isinstance(layer, PPMissingLayer):  # another pipeline stage's layer
                layer.self_attn.rotary_emb = rotary

    @classmethod
    def verify_config(cls, config: Any, max_model_len: int) -> None:
        """Sliding windows are implemented, so any ``max_model_len`` is served; the MLP is Llama's
        SwiGLU, so ``hidden_act`` must be silu."""
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Phi3ForCausalLM with hidden_act={act!r} is not supported (only silu)")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(split_fused(self.config, weights))
