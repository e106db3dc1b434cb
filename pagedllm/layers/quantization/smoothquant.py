"""SmoothQuant (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models", arXiv 2211.10438): move the activation outliers of a linear layer's input
channels into its weights, so that one int8 scale per token fits the activations again.

For input channel j of ``y = x W^T``, with calibrated ``a_j = max |x_j|`` and ``w_j = max_i |W_ij|``,
``s_j = a_j^alpha / w_j^(1 - alpha)``; then ``y = (x / s) (W diag(s))^T``. The division by ``s`` is
folded into the op that produces ``x``, so at run time each layer is still one int8 matmul:

- qkv_proj and gate_up_proj input: the preceding RMSNorm's weight ``/ s`` (x = g * norm(h));
- down_proj input ``silu(gate) * up``: the up rows of gate_up (and their bias) ``/ s``;
- o_proj input, the attention output: the v rows of qkv (and their bias) ``/ s``. A KV head is read
  by ``G = num_heads / num_kv_heads`` query heads, so one factor per KV-head channel serves all G
  heads' o_proj columns (``a`` and ``w`` taken as the max over the group).

The final norm -> LM head is left alone: SmolLM2's head is tied to the embedding, whose rows must
not be scaled (smoothing only the head's int8 copy was tried: no measurable gain on SmolLM2).

``s`` is rounded to a power of two: every multiply and divide above is then exact in float32 and
bfloat16, so smoothing leaves the float model's function bit-for-bit unchanged, and a tiny
difference in the calibration statistics (e.g. tensor-parallel vs single-rank float sums) almost
never changes a factor (only when log2 s lies within rounding of a half-integer). On SmolLM2 the
power-of-two factors measured as well as unrounded ones (benchmarks/README.md, section 6).

This module is the layers' part: the factors (``smoothing_factors``) and the three folds above
(``smooth_norm_into``, ``smooth_mlp``, ``smooth_attention_output``), given the norm, MLP or attention
module and its linears' calibrated ``a``; it knows no model class. The calibration, which runs the
model and picks the layers it folds into, is ``pagedllm/models/smoothquant.py``. Tensor parallelism:
a column-parallel layer's ``w_j`` is the max over the ranks' rows (one all-reduce), the o_proj group
factors are computed from every rank's channels (all-reduce of zero-padded vectors), the down_proj
factors are local.

``PAGEDLLM_SMOOTHQUANT_ALPHA``: unset = the config's alpha; ``0`` = no smoothing; a value in (0, 1)
replaces alpha.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce_max

DEFAULT_SMOOTH_ALPHA = 0.65  # ``--quantization int8`` (measured on SmolLM2: benchmarks/README.md section 6)


def smoothquant_alpha(config_alpha: Optional[float]) -> Optional[float]:
    """The alpha to use (None: no smoothing): ``PAGEDLLM_SMOOTHQUANT_ALPHA`` overrides the config's.

    Raises:
        ValueError: the variable is not 0 or a number in (0, 1).
    """
    alpha = envs.PAGEDLLM_SMOOTHQUANT_ALPHA  # None when unset; raises ValueError when out of range
    if alpha is None:
        return config_alpha
    return None if alpha == 0 else alpha


def smoothing_factors(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = a^alpha / w^(1 - alpha)`` rounded to the nearest power of two (float32, same shape);
    1 where a channel never activated or has no weight (nothing to balance)."""
    a, w = act_amax.float(), weight_amax.float()
    s = a.clamp_min(1e-5).pow(alpha) / w.clamp_min(1e-5).pow(1 - alpha)
    # |log2 s| <= 12 keeps g / s and W * s normal and finite even in float16 (SmolLM2 needs <= 7).
    s = torch.exp2(torch.log2(s).round().clamp_(-12, 12))
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


def _column_amax(linear: nn.Module) -> torch.Tensor:
    """max_i |W_ij| over every rank's output rows (column-parallel layers split the rows)."""
    return tensor_model_parallel_all_reduce_max(linear.weight.detach().abs().amax(0).float())


def smooth_norm_into(norm: nn.Module, linear: nn.Module, a: torch.Tensor, alpha: float) -> None:
    """``linear``'s input is ``norm``'s output (``a``: its per-channel max |x|, float32 [in_features]):
    the norm's weight ``/ s``, the linear's columns ``* s``."""
    s = smoothing_factors(a, _column_amax(linear), alpha)
    norm.weight.data.div_(s.to(norm.weight.dtype))
    linear.weight.data.mul_(s.to(linear.weight.dtype))


def smooth_mlp(mlp: nn.Module, a: torch.Tensor, alpha: float) -> None:
    """down_proj input = silu(gate) * up: divide the up rows (the second half of gate_up)."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    s = smoothing_factors(a, down.weight.detach().abs().amax(0), alpha)  # row-parallel: whole columns here
    inter = gate_up.output_sizes[0]
    gate_up.weight.data[inter:].div_(s.to(gate_up.weight.dtype)[:, None])
    if gate_up.bias is not None:
        gate_up.bias.data[inter:].div_(s.to(gate_up.bias.dtype))
    down.weight.data.mul_(s.to(down.weight.dtype))


def smooth_attention_output(attn: nn.Module, a: torch.Tensor, alpha: float) -> None:
    """o_proj input = attention output: one factor per KV-head channel, shared by the G query heads
    of that KV head, computed from every rank's channels so that all ranks (and TP=1) agree."""
    qkv, o = attn.qkv_proj, attn.o_proj
    tp, rank, d = qkv.tp_size, qkv.tp_rank, qkv.head_dim
    heads, kv_heads = qkv.num_heads, qkv.num_kv_heads  # this rank's
    total_heads = heads * tp
    total_kv = kv_heads * tp // qkv.num_kv_replicas
    group = total_heads // total_kv
    act = torch.zeros(total_heads * d, device=a.device)
    wgt = torch.zeros_like(act)
    act[rank * heads * d:(rank + 1) * heads * d] = a
    wgt[rank * heads * d:(rank + 1) * heads * d] = o.weight.detach().abs().amax(0).float()
    act, wgt = tensor_model_parallel_all_reduce_max(act), tensor_model_parallel_all_reduce_max(wgt)
    s = smoothing_factors(act.view(total_kv, group, d).amax(1), wgt.view(total_kv, group, d).amax(1), alpha)
    kv0 = (rank // qkv.num_kv_replicas) * kv_heads
    s_v = s[kv0:kv0 + kv_heads].reshape(-1)
    v_rows = slice(qkv.q_size + qkv.kv_size, qkv.q_size + 2 * qkv.kv_size)
    qkv.weight.data[v_rows].div_(s_v.to(qkv.weight.dtype)[:, None])
    if qkv.bias is not None:
        qkv.bias.data[v_rows].div_(s_v.to(qkv.bias.dtype))
    s_o = s[torch.arange(rank * heads, (rank + 1) * heads, device=s.device) // group].reshape(-1)
    o.weight.data.mul_(s_o.to(o.weight.dtype))
