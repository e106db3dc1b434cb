"""Llama 4 text models (Meta, 2025, "The Llama 4 herd"; transformers' ``modeling_llama4.py``; Scout
17B-16E, Maverick 17B-128E), also the language model of ``Llama4ForConditionalGeneration``:

- attention without biases; RoPE on the layers ``no_rope_layers`` marks 1 (every 4th layer has
  none), in the interleaved layout (pairs 2i, 2i + 1: the q/k rows are moved to the halves layout at
  load, as for ERNIE 4.5); on those layers an RMS norm without weight on q and k after RoPE
  (``use_qk_norm``); on the NoPE layers the queries scaled by
  ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (``attn_temperature_tuning``);
- MoE feed-forward on the ``moe_layers``: a router picks the top-k experts by logit and weighs each by
  the sigmoid of its logit, applied to the expert's *input*; a shared expert every token goes through;
  dense SwiGLU (``intermediate_size_mlp``) on the other layers.

The layers ``layer_types`` calls ``chunked_attention`` (the RoPE layers) attend within chunks of
``attention_chunk_size`` positions (the backends' ``attention_chunk``); the others see the whole context.
Checkpoints keep each layer's experts stacked: ``feed_forward.experts.gate_up_proj`` [E, H, 2I] (gate
columns, then up) and ``down_proj`` [E, I, H], split here into the fused layer's per-expert shards.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear, load_full
from pagedllm.models.ernie4_5 import interleaved_qk_to_half
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, PPMissingLayer


def nope_query_scale(positions: torch.Tensor, attn_scale: float, floor_scale: float) -> torch.Tensor:
    """[N] float32: Llama 4's attention temperature of the NoPE layers, in transformers' operations."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(LlamaAttention):
    """LlamaAttention whose ``use_rope``, ``qk_l2_norm`` (eps, or None), ``temperature``
    ((attn_scale, floor_scale), or None) and ``attention_chunk`` the model sets per layer."""

    use_rope = True
    qk_l2_norm: Optional[float] = None
    temperature: Optional[tuple[float, float]] = None
    attention_chunk: Optional[int] = None

    @staticmethod
    def _l2(x: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, cos_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.split_heads(self.qkv_proj(x))
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k, cos_sin=cos_sin if cos_sin is not None
                                   else self.rotary_emb.cos_sin(positions))
            if self.qk_l2_norm is not None:
                q, k = self._l2(q, self.qk_l2_norm), self._l2(k, self.qk_l2_norm)
        elif self.temperature is not None:
            scale = meta.derived.get("llama4.nope_scale")  # once a step, shared by the NoPE layers
            if scale is None:
                scale = meta.derived["llama4.nope_scale"] = nope_query_scale(positions, *self.temperature)
            q = q * scale.to(q.dtype).view(-1, 1, 1)
        if self.attention_chunk is None:
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, attention_chunk=self.attention_chunk)
        return self.o_proj(o.reshape(n, -1))


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Llama4Attention


class Llama4MoE(nn.Module):
    """``router`` + routed ``experts`` (sigmoid weights on their input) + ``shared_expert``. [N, H] -> [N, H]."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        e, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, e, bias=False, dtype=dtype)
        self.experts = FusedMoE(e, self.top_k, config.hidden_size, config.intermediate_size, renormalize=False,
                                dtype=dtype, reduce_results=False)
        self.shared_expert = LlamaMLP(config.hidden_size, config.intermediate_size, bias=False, dtype=dtype,
                                      reduce_results=False)  # one all-reduce, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, ids = torch.topk(self.router(x), self.top_k, dim=1)
        weights = torch.sigmoid(values.float()).to(x.dtype)
        out = self.experts.compute(x, weights, ids, weights_on_input=True)
        return tensor_model_parallel_all_reduce(out + self.shared_expert(x))


def split_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``feed_forward`` -> ``mlp``, and the stacked experts as per-expert shards (w1 gate [I, H], w3 up,
    w2 down [H, I]) for ``FusedMoE.expert_params_mapping("w1", "w3", "w2")``."""
    for name, w in weights:
        name = name.replace(".feed_forward.", ".mlp.")
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I]
            t = load_full(w)
            inter = t.shape[2] // 2
            for e in range(t.shape[0]):
                yield f"{name[:-len('gate_up_proj')]}{e}.w1.weight", t[e, :, :inter].T
                yield f"{name[:-len('gate_up_proj')]}{e}.w3.weight", t[e, :, inter:].T
        elif name.endswith(".mlp.experts.down_proj"):  # [E, I, H]
            t = load_full(w)
            for e in range(t.shape[0]):
                yield f"{name[:-len('down_proj')]}{e}.w2.weight", t[e].T
        else:
            yield name, w


class Llama4ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Llama4DecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        self.stacked_params = FusedMoE.expert_params_mapping("w1", "w3", "w2", config.num_local_experts) \
            + LlamaForCausalLM.stacked_params
        tuning = getattr(config, "attn_temperature_tuning", False)
        chunk = getattr(config, "attention_chunk_size", None)
        types = getattr(config, "layer_types", None) or ["chunked_attention" if r else "full_attention"
                                                         for r in self.rope_flags(config)]
        for layer, rope, kind in zip(self.layers, self.rope_flags(config), types):
            if isinstance(layer, PPMissingLayer):
                continue
            attn = layer.self_attn
            attn.use_rope = rope
            if kind == "chunked_attention" and chunk:
                attn.attention_chunk = int(chunk)
            if rope and getattr(config, "use_qk_norm", False):
                attn.qk_l2_norm = float(config.rms_norm_eps)
            if not rope and tuning:
                attn.temperature = (float(config.attn_scale), float(config.floor_scale))

    @staticmethod
    def rope_flags(config: Any) -> list[bool]:
        flags = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        return [bool(f) for f in flags]

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if layer_idx in (getattr(config, "moe_layers", None) or []):
            return Llama4MoE(config, dtype)
        return LlamaMLP(config.hidden_size, config.intermediate_size_mlp, bias=False, dtype=dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(interleaved_qk_to_half(split_experts(weights), self.rotary_emb))
