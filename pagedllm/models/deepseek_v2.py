"""DeepSeek-V2 / V3 (and the models built on them: Kimi K2, GLM-4.7-Flash's ``Glm4MoeLite``, and
OpenBMB's MiniCPM3, dense) with multi-head latent attention (MLA; DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and
Efficient Mixture-of-Experts Language Model", section 2.1; transformers' ``modeling_deepseek_v2.py``,
``modeling_deepseek_v3.py``).

MLA compresses each token's keys and values into one latent c (``kv_lora_rank`` L wide, RMS-normed)
plus one RoPE key k_r (``qk_rope_head_dim`` R wide) shared by all heads. Head h's key is
[W_UK[h] c, k_r] and its value W_UV[h] c, where ``kv_b_proj`` stacks W_UK and W_UV per head.

The paged KV cache holds only [c, k_r] (one KV head of L + R channels: 576 for V2/V3 instead of
128 heads x 320), as vLLM does. Attention runs on it through the same backends as every model, by
absorbing the up-projections (the paper's section 2.1.3): the query of head h becomes
[W_UK[h]^T q_nope, q_r], so q.k = q_nope.(W_UK c) + q_r.k_r, and the value read is c itself, whose
weighted sum W_UV[h] maps to the head's output. Scores and outputs are the same sums in another
order (fp32 greedy ids equal transformers').

Feed-forward: dense SwiGLU on the first ``first_k_dense_replace`` layers (or where
``mlp_layer_types`` says "dense"), then routed experts plus shared experts:
- V2: softmax router, top-k (``greedy``) or top-k within the ``topk_group`` groups of best expert
  (``group_limited_greedy``), weights scaled by ``routed_scaling_factor``;
- V3 / Kimi K2 / GLM-4.7-Flash: the sigmoid router with a correction bias (``glm4_moe.grouped_topk``).

RoPE: V2 rotates interleaved pairs (complex multiplication); V3 too where ``rope_interleave`` (its
default): the RoPE rows of the query and latent projections are moved to the rotate-half layout at
load (scores are unchanged by reordering both sides alike). YaRN with DeepSeek's ``mscale`` /
``mscale_all_dim``; the softmax scale is (qk_nope + qk_rope)^-0.5 times mscale(factor,
mscale_all_dim)^2. The multi-token-prediction layer V3 checkpoints carry is loaded apart, by speculative
decoding's ``mtp`` method (``models/mtp.py``).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.config import get_rope_parameters
from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, _copy, load_full,
                                    load_narrow)
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.rotary_longrope import LONGROPE_TYPES, get_phi3_rope
from pagedllm.models.glm4_moe import Glm4MoeBlock, Glm4MoeRouter, SharedExpertsMoeBlock
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, make_rotary_embedding
from pagedllm.models.mtp import skip_mtp_layers

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not the config's
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: Any) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN
    (DeepSeek's ``yarn_get_mscale``: 0.1 * m * ln(factor) + 1 when factor > 1)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = get_rope_parameters(config)
    m_all = rope.get("mscale_all_dim") if rope.get("rope_type", "default") != "default" else None
    factor = float(rope.get("factor") or 1.0)
    if m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class MLAKVUpProjection(nn.Module):
    """``kv_b_proj``: ``weight`` [H/tp * (qk_nope + v), L], this rank's heads (whole heads, so the
    rows split evenly as a column-parallel linear's). Not a linear layer: attention uses it only
    through ``w_uk`` [H/tp, qk_nope, L] and ``w_uv_t`` [H/tp, L, v], the absorbed up-projections."""

    def __init__(self, num_heads: int, nope: int, v_dim: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v_dim = num_heads, nope, v_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v_dim), rank, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self._split: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = param.shape[0]
        _copy(param, param.data, load_narrow(loaded, 0, get_tp_rank() * rows, rows))
        self._split = None

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, nope, L], w_uv_t [H, L, v]), contiguous for ``torch.bmm``; made once after loading."""
        if self._split is None:
            w = self.weight.view(self.num_heads, self.nope + self.v_dim, -1)
            self._split = (w[:, :self.nope].contiguous(), w[:, self.nope:].transpose(1, 2).contiguous())
        return self._split


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention. forward(positions [N], x [N, hidden], kv_cache, meta, cos_sin)
    -> [N, hidden]. The backend sees H/tp query heads and one KV head of ``head_dim`` = L + R
    channels (what the model runner sizes the cache by); K and V are both [c, k_r], and the first L
    channels of each head's output are its latent-space value. The latent is replicated on every
    tensor-parallel rank; the heads are split."""

    def __init__(self, config: Any, dtype: torch.dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__()
        tp = get_tp_size()
        heads = config.num_attention_heads
        if heads % tp:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size {tp}")
        self.num_heads, self.num_kv_heads = heads // tp, 1
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = self.nope + self.rope_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.head_dim = self.kv_lora_rank + self.rope_dim  # the cache's
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * self.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(config.hidden_size, self.kv_lora_rank + self.rope_dim, bias=bias,
                                                   dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = MLAKVUpProjection(self.num_heads, self.nope, self.v_head_dim, self.kv_lora_rank, dtype)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, config.hidden_size, bias=bias, dtype=dtype)
        self.rotary_emb = rotary_emb or make_rotary_embedding(config, self.rope_dim, dtype)
        self.scale = mla_softmax_scale(config)
        self.backend = backend
        self.kv_shared = True  # the cache holds [c, k_r] once: keys and values are the same tensor

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Optional[torch.Tensor],
                meta: AttentionMetadata, cos_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, h, lat = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(n, h, self.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(x)  # [N, L + R]
        kv = torch.empty(n, 1, self.head_dim, dtype=x.dtype, device=x.device)  # [c, k_r]: what the cache holds
        kv[:, 0, :lat] = self.kv_a_layernorm(latent[:, :lat].contiguous())
        kv[:, 0, lat:] = latent[:, lat:]
        w_uk, w_uv_t = self.kv_b_proj.split()
        q_abs = torch.empty(n, h, self.head_dim, dtype=x.dtype, device=x.device)
        q_abs[:, :, :lat] = torch.bmm(q[:, :, :self.nope].transpose(0, 1), w_uk).transpose(0, 1)  # W_UK^T q_nope
        q_abs[:, :, lat:] = q[:, :, self.nope:]
        if cos_sin is None:
            cos_sin = self.rotary_emb.cos_sin(positions)
        self.rotary_emb.apply_(q_abs[:, :, lat:], cos_sin)  # in place
        self.rotary_emb.apply_(kv[:, :, lat:], cos_sin)
        o = self.backend.forward(q_abs, kv, kv, kv_cache, meta, self.scale)  # [N, H, L + R]
        o = torch.bmm(o[:, :, :lat].transpose(0, 1), w_uv_t)  # [H, N, v]: W_UV times the attended latent
        return self.o_proj(o.transpose(0, 1).reshape(n, h * self.v_head_dim))


def deepseek_v2_topk(logits: torch.Tensor, top_k: int, method: str, num_groups: Optional[int],
                     topk_group: Optional[int], scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing (transformers' ``DeepseekV2TopkRouter``): the top-k softmax scores times
    ``scaling``. logits [N, E] float32 -> (weights [N, top_k] float32, ids [N, top_k] int64).
    ``group_limited_greedy``: experts only from the ``topk_group`` groups (of ``num_groups``) whose
    best expert scores highest. Raises ValueError on another method.

    ``norm_topk_prob`` is not read, as transformers does not (it is false in every released V2
    config; DeepSeek's code renormalizes instead of scaling when it is set, vLLM does both)."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        n, e = scores.shape
        group_scores = scores.view(n, num_groups, e // num_groups).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, num_groups, e // num_groups).reshape(n, e)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
    elif method != "greedy":
        raise ValueError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling, ids


class DeepseekV2MoeBlock(SharedExpertsMoeBlock):
    """DeepSeek-V2's softmax router (``deepseek_v2_topk``) over the shared-experts block."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        method = getattr(config, "topk_method", None) or "greedy"
        num_experts, num_groups, topk_group = config.n_routed_experts, config.n_group, config.topk_group
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        if method == "group_limited_greedy" and (
                not num_groups or num_experts % num_groups or not 0 < (topk_group or 0) <= num_groups):
            raise ValueError(f"group_limited_greedy needs n_routed_experts={num_experts} split into n_group="
                             f"{num_groups} equal groups, of which topk_group={topk_group} are kept")
        super().__init__(config, dtype)
        self.method, self.num_groups, self.topk_group = method, num_groups, topk_group
        self.gate = Glm4MoeRouter(config.hidden_size, num_experts, correction_bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return deepseek_v2_topk(self.gate(x), self.top_k, self.method, self.num_groups, self.topk_group, self.scaling)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV2Attention


def _rope_rows_to_half(rows: torch.Tensor, block: int, start: int, width: int) -> torch.Tensor:
    """rows [k * block, ...] -> the same rows with channels start..start + width of each block of
    ``block`` rows reordered from interleaved pairs (0, 1), (2, 3), ... to evens then odds."""
    perm = torch.cat([torch.arange(start), start + torch.arange(0, width, 2), start + torch.arange(1, width, 2),
                      torch.arange(start + width, block)])
    return rows.reshape(-1, block, *rows.shape[1:])[:, perm].reshape(rows.shape)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 (``DeepseekV2ForCausalLM``); V3 and its relatives subclass it."""

    decoder_layer_cls = DeepseekV2DecoderLayer
    use_cpu_layer_runner = False  # the runner covers Llama-style q/k/v attention, not MLA
    # RoPE on interleaved pairs: V2 always (its config's rope_interleave, if any, is not read, as in
    # transformers); V3 and its relatives where rope_interleave is true or absent; MiniCPM3 never.
    reads_rope_interleave = False
    rope_interleave_default = True

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(config, dtype, backend)
        rotary = self.make_rope(config, dtype)
        if rotary is not None:  # one table for every layer
            self.rotary_emb = rotary
            for layer in self.layers:
                if isinstance(layer, DeepseekV2DecoderLayer):
                    layer.self_attn.rotary_emb = rotary
        # Experts first (``experts.N.gate_proj`` would match the dense rule); no q/k/v fusion (V2-Lite's
        # ``q_proj`` is a parameter of its own).
        experts = getattr(config, "n_routed_experts", None) or 0
        self.stacked_params = FusedMoE.expert_params_mapping("gate_proj", "up_proj", "down_proj", experts) \
            + [("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]

    def make_rope(self, config: Any, dtype: torch.dtype) -> Optional[RotaryEmbedding]:
        """The RoPE table over qk_rope_head_dim channels, where the one built from ``head_dim`` is not it
        (None: keep that one)."""
        if self.rotary_emb.head_dim == config.qk_rope_head_dim:
            return None
        return make_rotary_embedding(config, config.qk_rope_head_dim, dtype)

    @staticmethod
    def is_moe_layer(config: Any, layer_idx: int) -> bool:
        types = getattr(config, "mlp_layer_types", None)  # GLM-4.7-Flash's
        if types:  # (an MTP layer, past the list, is sparse)
            return layer_idx >= len(types) or types[layer_idx] == "sparse"
        return layer_idx >= (config.first_k_dense_replace or 0)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        return DeepseekV2MoeBlock(config, dtype) if self.is_moe_layer(config, layer_idx) else None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        # (the multi-token-prediction layers go to spec_decode's MTP proposer, not here: models/mtp.py)
        return super().load_weights(self.prepare_weights(skip_mtp_layers(weights, self.config.num_hidden_layers)))

    def prepare_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The RoPE rows of the query and latent projections moved to the rotate-half layout where the
        checkpoint interleaves them (the MTP layer's too: ``models/mtp.py``)."""
        interleaved = self.rope_interleave_default
        if self.reads_rope_interleave:
            interleaved = getattr(self.config, "rope_interleave", interleaved)
        return self._interleaved_rope_to_half(weights) if interleaved else weights

    def _interleaved_rope_to_half(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        c = self.config
        nope, rope, lat = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        for name, w in weights:
            if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
                w = _rope_rows_to_half(load_full(w), nope + rope, nope, rope)
            elif ".self_attn.kv_a_proj_with_mqa." in name:
                w = _rope_rows_to_half(load_full(w), lat + rope, lat, rope)
            yield name, w


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 / V3.1, Kimi K2 (``DeepseekV3ForCausalLM``): V2's attention with V3's sigmoid
    router (GLM-4.5's block); RoPE interleaved unless ``rope_interleave`` is false."""

    reads_rope_interleave = True
    mtp_layout = "deepseek"  # its MTP layer at model.layers.{num_hidden_layers} (models/mtp.py)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        return Glm4MoeBlock(config, dtype) if self.is_moe_layer(config, layer_idx) else None


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's attention and router, with dense
    and sparse layers named by ``mlp_layer_types``."""


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    """MiniCPM3 (OpenBMB, 2024; transformers' ``modeling_minicpm3.py``): DeepSeek-V2's attention with
    RoPE in the rotate-half layout (LongRoPE in MiniCPM3-4B), dense SwiGLU MLPs, and MiniCPM's
    scalings: embeddings times ``scale_emb``, each residual branch times scale_depth /
    sqrt(num_hidden_layers), the final hidden states divided by hidden_size / dim_model_base
    before the LM head."""

    rope_interleave_default = False

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None,
                 max_model_len: Optional[int] = None) -> None:
        rope = get_rope_parameters(config)
        longrope = rope.get("rope_type", "default") in LONGROPE_TYPES
        base = config
        if longrope:  # the layers are built with a placeholder RoPE, then share the LongRoPE table (as Phi-3's)
            base = copy.copy(config)
            base.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
            base.max_position_embeddings = 1
            if "rope_scaling" in vars(base):  # transformers 4.x keeps it apart (5.x: an alias of the above)
                base.rope_scaling = None
        super().__init__(base, dtype, backend)
        self.config = config
        if longrope:
            rotary = get_phi3_rope(config.qk_rope_head_dim, config.max_position_embeddings, rope, dtype,
                                   max_model_len or config.max_position_embeddings)
            self.rotary_emb = rotary
            for layer in self.layers:
                if isinstance(layer, DeepseekV2DecoderLayer):
                    layer.self_attn.rotary_emb = rotary
        branch = float(config.scale_depth) / math.sqrt(config.num_hidden_layers)
        for layer in self.layers:
            if isinstance(layer, DeepseekV2DecoderLayer):
                layer.residual_multiplier = branch
        # transformers keeps the scale as a float32 buffer cast to the weights' dtype
        self.embed_scale = float(torch.tensor(float(config.scale_emb)).to(dtype))
        self.logits_scaling = config.hidden_size / (config.dim_model_base or config.hidden_size)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> Optional[nn.Module]:
        return None

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).mul_(self.embed_scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_scaling != 1.0:
            hidden = hidden / self.logits_scaling
        return self.lm_head.compute_logits(hidden).float()
