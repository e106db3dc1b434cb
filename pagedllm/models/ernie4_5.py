"""ERNIE 4.5 dense models (Baidu, 2025, "ERNIE 4.5 Technical Report"; transformers'
``modeling_ernie4_5.py``; ERNIE-4.5-0.3B): Llama's decoder with biases on every linear or on none
(``use_bias``) and interleaved RoPE: each head's channel pairs (2i, 2i + 1) rotate together (GPT-J's
layout) where Llama rotates (i, i + D/2).

A score is the dot product of a query and a key, which one permutation of each head's channels
applied to both leaves unchanged; so the loader moves the rows of the q and k projections to Llama's
layout (channel 2i to i, 2i + 1 to D/2 + i) and Llama's RoPE, kernels and layer runner do the rest.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Optional

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.linear import load_full
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaForCausalLM


def interleaved_to_half(rows: torch.Tensor, head_dim: int, rotary_dim: Optional[int] = None) -> torch.Tensor:
    """rows [num_heads * head_dim, ...] (a q or k projection's weight or bias) -> the same rows with
    the first ``rotary_dim`` (default: all) channels of each head reordered 0, 2, 4, ..., then
    1, 3, 5, ...; the channels after them stay where they are."""
    r = head_dim if rotary_dim is None else rotary_dim
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, head_dim)])
    return rows.reshape(-1, head_dim, *rows.shape[1:])[:, perm].reshape(rows.shape)


def interleaved_qk_to_half(weights: Iterable[tuple[str, Any]], rotary: RotaryEmbedding
                           ) -> Iterator[tuple[str, Any]]:
    """Checkpoint (name, tensor) pairs with the q and k projections' rows (weights and biases) moved
    from the interleaved RoPE layout to ``rotary``'s rotate-half one (``interleaved_to_half``); the
    loader of every model with interleaved RoPE (ERNIE 4.5, GLM, Cohere)."""
    for name, w in weights:
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            w = interleaved_to_half(load_full(w), rotary.head_dim, rotary.rotary_dim)
        yield name, w


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        biased = copy.copy(config)  # use_bias covers q/k/v, o and the MLP: Llama's two flags
        biased.attention_bias = biased.mlp_bias = bool(getattr(config, "use_bias", False))
        super().__init__(biased, dtype, backend)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(interleaved_qk_to_half(weights, self.rotary_emb))
