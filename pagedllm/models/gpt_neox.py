"""GPT-NeoX (Black et al., 2022, "GPT-NeoX-20B"; transformers' ``modeling_gpt_neox.py``): Pythia,
GPT-NeoX-20B, Dolly v2, RedPajama-INCITE. LayerNorms with biases; RoPE on the first
``partial_rotary_factor`` (``rotary_pct``, 0.25) of each head's channels; q, k and v fused in one
projection laid out head by head ([q_h, k_h, v_h] for each head h); a plain GELU MLP; with
``use_parallel_residual`` (the default) x + attn(ln1(x)) + mlp(ln2(x)), summed as (mlp + attn) + x.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import load_full
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, PPMissingLayer
from pagedllm.models.starcoder2 import Starcoder2MLP

# checkpoint name fragment -> ours (Llama's layout, StarCoder2's MLP); "gpt_neox." goes last
_RENAMES = ((".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
            (".mlp.dense_4h_to_h.", ".mlp.c_proj."), ("gpt_neox.embed_in.", "embed_tokens."),
            ("gpt_neox.final_layer_norm.", "norm."), ("embed_out.", "lm_head."), ("gpt_neox.", ""))


class GPTNeoXDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 mlp: Optional[nn.Module] = None, rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, dtype, backend, qkv_bias, False, rotary_emb)
        self.mlp = mlp if mlp is not None else Starcoder2MLP(config.hidden_size, config.intermediate_size,
                                                             config.hidden_act, True, dtype)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.parallel_residual = getattr(config, "use_parallel_residual", True)

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                      kv_cache, meta, cos_sin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the branches' output, the stream), summed by the next add in transformers' order."""
        stream = x if residual is None else residual.add_(x)
        attn = self.self_attn(positions, self.input_layernorm(stream), kv_cache, meta, cos_sin)
        if self.parallel_residual:  # (mlp + attn) + x
            return self.mlp(self.post_attention_layernorm(stream)).add_(attn), stream
        stream.add_(attn)
        return self.mlp(self.post_attention_layernorm(stream)), stream


class GPTNeoXForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GPTNeoXDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        config = copy.copy(config)  # what Llama's model reads: the final norm's epsilon, the partial RoPE
        config.rms_norm_eps = config.layer_norm_eps
        if getattr(config, "partial_rotary_factor", None) is None and hasattr(config, "rotary_pct"):
            config.partial_rotary_factor = config.rotary_pct  # transformers 4.x
        super().__init__(config, dtype, backend)
        if not isinstance(self.norm, PPMissingLayer):
            self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def _split_qkv(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        c = self.config
        heads = c.num_attention_heads
        for name, w in weights:
            if name.endswith((".attention.bias", ".attention.masked_bias")):
                continue  # old checkpoints' causal-mask buffers
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if ".attention.query_key_value." in name:
                full = load_full(w)
                per_head = full.reshape(heads, 3, -1, *full.shape[1:])  # [H, (q, k, v), D, ...]
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    yield (name.replace(".attention.query_key_value.", f".self_attn.{part}."),
                           per_head[:, i].reshape(-1, *full.shape[1:]))
                continue
            yield name, w

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_qkv(weights))
