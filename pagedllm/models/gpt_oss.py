"""gpt-oss (OpenAI, 2025, "gpt-oss-120b & gpt-oss-20b Model Card"; transformers'
``modeling_gpt_oss.py``): Llama-style pre-norm blocks with

- attention with biases on q/k/v/o and a learned **attention sink** per head (one more logit in
  every softmax, with no value: see ``AttentionBackend``), sliding-window (128) and global layers
  alternating per ``layer_types``, YaRN RoPE;
- a sparse MoE block on every layer: a router with a bias picks ``num_experts_per_tok`` experts by
  their logits and weights them by a softmax over the chosen logits; each expert has biases and a
  clamped SwiGLU, ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``.

Checkpoints: the experts as transformers writes them (``mlp.experts.gate_up_proj`` [E, H, 2I] with
gate and up columns interleaved, ``down_proj`` [E, I, H], their ``_bias``), or OpenAI's MXFP4
(``gate_up_proj_blocks``/``_scales`` [E, 2I, H/32, 16]/[E, 2I, H/32], the same for ``down_proj``),
dequantized at load (``layers/quantization/mxfp4.py``). The router is ``mlp.router``.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.fused_moe import fused_experts
from pagedllm.layers.linear import ReplicatedLinear, _copy, load_full, load_narrow, loaded_shape
from pagedllm.layers.quantization import mxfp4
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[M, 2I] (gate columns, then up) -> [M, I]: gpt-oss's expert activation, in transformers'
    operations and order (``GptOssExperts._apply_gate``)."""
    inter = gate_up.shape[1] // 2
    gate = gate_up[:, :inter].clamp(min=None, max=limit)
    up = gate_up[:, inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """The routed experts, tensor-parallel over the intermediate dimension (every rank holds every
    expert's slice, as ``FusedMoE``). Parameters: ``gate_up_proj`` [E, 2I/tp, H] (this rank's gate
    rows, then its up rows), ``gate_up_proj_bias`` [E, 2I/tp], ``down_proj`` [E, H, I/tp],
    ``down_proj_bias`` [E, H] (added on rank 0 only: the ranks' partial sums are all-reduced).

    forward: x [N, H], topk_weights [N, k], topk_ids [N, k] -> this rank's partial output [N, H].
    """

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp_size()
        e, h, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        if inter % tp:
            raise ValueError(f"expert intermediate size {inter} is not divisible by tensor_parallel_size {tp}")
        self.tp_rank, self.inter = get_tp_rank(), inter // tp
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        shapes = {"gate_up_proj": (e, 2 * self.inter, h), "gate_up_proj_bias": (e, 2 * self.inter),
                  "down_proj": (e, h, self.inter), "down_proj_bias": (e, h)}
        for name, shape in shapes.items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = getattr(self, f"_load_{name}")
            setattr(self, name, p)

    def _rank_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[..., 2I] with gate and up interleaved -> [..., 2, I/tp]: this rank's gate, then up."""
        t = t.unflatten(-1, (-1, 2)).narrow(-2, self.tp_rank * self.inter, self.inter)
        return t.transpose(-1, -2)

    def _check(self, name: str, loaded: Any, expected: tuple) -> torch.Tensor:
        if tuple(loaded_shape(loaded)) != expected:
            raise ValueError(f"weight shape mismatch for experts.{name}: expected {expected}, "
                             f"got {tuple(loaded_shape(loaded))}")
        return load_full(loaded)

    def _load_gate_up_proj(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        e, rows, h = param.shape
        w = self._check("gate_up_proj", loaded, (e, h, rows * get_tp_size()))  # [E, H, 2I]
        _copy(param, param.data, self._rank_columns(w).permute(0, 2, 3, 1).flatten(1, 2))  # [E, H, 2, I] -> [E, 2I, H]

    def _load_gate_up_proj_bias(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        e, rows = param.shape
        b = self._check("gate_up_proj_bias", loaded, (e, rows * get_tp_size()))
        _copy(param, param.data, self._rank_columns(b).flatten(1, 2))

    def _load_down_proj(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        e, h, cols = param.shape
        self._check("down_proj", loaded, (e, cols * get_tp_size(), h))  # [E, I, H]
        _copy(param, param.data, load_narrow(loaded, 1, self.tp_rank * cols, cols).transpose(1, 2))

    def _load_down_proj_bias(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _copy(param, param.data, self._check("down_proj_bias", loaded, tuple(param.shape)))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             w13_bias=self.gate_up_proj_bias,
                             w2_bias=self.down_proj_bias if self.tp_rank == 0 else None,
                             activation=lambda gu: clamped_swiglu(gu, self.alpha, self.limit))


class GptOssMoE(nn.Module):
    """``router`` (replicated, with a bias) + ``experts``: the top-k experts by router logit, weighted
    by a softmax over those k logits (transformers' ``GptOssTopKRouter``). forward: [N, H] -> [N, H]."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        if not 0 < self.top_k <= config.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_local_experts="
                             f"{config.num_local_experts}]")
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True, dtype=dtype)
        self.experts = GptOssExperts(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=torch.float32)
        return tensor_model_parallel_all_reduce(self.experts(x, weights, ids))


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases and ``sinks`` [H/tp] float32, this rank's heads' sink logits."""

    def __init__(self, config: Any, dtype, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool,
                 rotary_emb=None) -> None:
        super().__init__(config, dtype, backend, qkv_bias, qk_norm, rotary_emb)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        total = self.num_heads * get_tp_size()
        if loaded_shape(loaded) != [total]:
            raise ValueError(f"weight shape mismatch for sinks: expected ({total},), got {tuple(loaded_shape(loaded))}")
        _copy(param, param.data, load_narrow(loaded, 0, get_tp_rank() * self.num_heads, self.num_heads))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer
    sliding_window_by_default = True  # no use_sliding_window flag: layer_types says which layers slide
    stacked_params = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v")]

    def __init__(self, config: Any, dtype: torch.dtype, backend: Optional[AttentionBackend] = None) -> None:
        if not hasattr(config, "attention_bias"):
            config.attention_bias = True  # gpt-oss's default (q/k/v and o)
        super().__init__(config, dtype, backend)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return GptOssMoE(config, dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(_dequantized(weights))


def _dequantized(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each MXFP4 pair ``<name>_blocks`` + ``<name>_scales`` [E, out,
    in/32, ...] replaced by ``<name>`` in transformers' layout [E, in, out], float32 (exact)."""
    pending: dict[str, dict[str, Any]] = {}
    for name, w in weights:
        for part in ("_blocks", "_scales"):
            if name.endswith(part):
                base = name[:-len(part)]
                got = pending.setdefault(base, {})
                got[part] = load_full(w)
                if len(got) == 2:
                    del pending[base]
                    yield base, mxfp4.dequantize(got["_blocks"], got["_scales"]).transpose(1, 2)
                break
        else:
            yield name, w
    if pending:
        raise ValueError(f"MXFP4 tensors without their pair (blocks and scales): {sorted(pending)[:4]}")
