"""Sparse mixture-of-experts feed-forward (Shazeer et al., 2017; Mixtral: Jiang et al., 2024,
"Mixtral of Experts"; Qwen2-MoE / Qwen3-MoE), tensor-parallel.

Each token's router logits pick ``top_k`` of ``num_experts`` SwiGLU experts; the token's output is
the routing-weighted sum of theirs. Computation is grouped by expert, as vLLM's ``fused_moe`` does:
the (token, expert) pairs are sorted by expert id, each expert runs one matmul over all of its
tokens (gathered with ``index_select``), and the weighted results are scattered back with one
``index_add_``. The Python loop runs over experts that received tokens, never over tokens; on
CUDA in bf16, torch's grouped GEMM (``F.grouped_mm``) replaces that loop with one kernel.

Tensor parallelism (Megatron-style, as vLLM shards experts): every rank holds every expert's slice
of the intermediate dimension, gate/up split column-wise and down row-wise, so each rank produces a
partial sum of the output and the block does one all-reduce after combining experts (and the shared
expert, when there is one).

Weights are stacked at load time: ``w13`` [E, 2 * I / tp, H] (gate rows, then up rows) and ``w2``
[E, H, I / tp], filled from the checkpoint's per-expert tensors (see ``expert_params_mapping``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from pagedllm.layers.linear import ReplicatedLinear, _copy, load_narrow, loaded_shape
from pagedllm.platforms import ops


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, then the ``top_k`` largest (as transformers' Mixtral and
    Qwen-MoE routers do); ``renormalize`` rescales the kept weights to sum to 1 per token (Mixtral
    always; Qwen when ``norm_topk_prob``).

    Args:
        router_logits: [num_tokens, num_experts], any float dtype.
    Returns:
        (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


# torch >= 2.10 names it F.grouped_mm; 2.8-2.9 have torch._grouped_mm; older torch has neither.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these operands by default (``ops.grouped_mm_supported``:
    the platform's say; CUDA: bf16, SM 8.0+, 16-byte aligned rows)."""
    return _GROUPED_MM is not None and ops.grouped_mm_supported(x, w13, w2)


def silu_and_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate columns, then up) -> silu(gate) * up [M, I]: the experts' SwiGLU."""
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, impl: Optional[str] = None, w13_bias: Optional[torch.Tensor] = None,
                  w2_bias: Optional[torch.Tensor] = None, activation=silu_and_mul_halves,
                  weights_on_input: bool = False) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t))), e = topk_ids[t, j]; act is
    SwiGLU, silu(gate) * up, unless ``activation`` says otherwise (gpt-oss's clamped one); with
    ``weights_on_input``, sum_j expert_e(topk_weights[t, j] * x_t) (Llama 4's; vLLM's
    ``apply_router_weight_on_input``).

    Args:
        x: [N, H] activations.
        w13: [E, 2 * I, H], gate rows then up rows of each expert.
        w2: [E, H, I].
        topk_weights: [N, k] routing weights (any float dtype; applied in ``x.dtype``).
        topk_ids: [N, k] expert ids in [0, E).
        impl: "loop" (one matmul per expert that has tokens: the reference, any device and dtype),
            "grouped" (torch's grouped GEMM, one kernel for all experts and no host sync), or None to
            take "grouped" where ``grouped_mm_supported`` says so.
        w13_bias: [E, 2 * I] or None; w2_bias: [E, H] or None (gpt-oss's expert biases).
        activation: [M, 2 * I] (gate columns, then up) -> [M, I].
    Returns:
        [N, H] in ``x.dtype``.
    """
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    # Sort the N*k (token, expert) pairs by expert; stable keeps token order inside an expert.
    order = torch.argsort(flat_ids, stable=True)
    token_idx = order // k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0])
    xs = x.index_select(0, token_idx)
    sorted_weights = topk_weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
    if weights_on_input:
        xs = xs * sorted_weights
    if impl is None:
        impl = "grouped" if grouped_mm_supported(x, w13, w2) else "loop"
    if impl == "grouped":
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end of each expert's rows
        sorted_ids = flat_ids.index_select(0, order) if w13_bias is not None or w2_bias is not None else None
        gate_up = _GROUPED_MM(xs, w13.transpose(1, 2), offs=offs)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias.index_select(0, sorted_ids)
        ys = _GROUPED_MM(activation(gate_up), w2.transpose(1, 2), offs=offs)
        if w2_bias is not None:
            ys = ys + w2_bias.index_select(0, sorted_ids)
    else:
        ys = torch.empty(num_tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, count in enumerate(counts.tolist()):  # one host sync per layer
            if count == 0:
                continue
            end = start + count
            gate_up = F.linear(xs[start:end], w13[e], None if w13_bias is None else w13_bias[e])
            ys[start:end] = F.linear(activation(gate_up), w2[e], None if w2_bias is None else w2_bias[e])
            start = end
    if not weights_on_input:
        ys = ys * sorted_weights
    return torch.zeros_like(x).index_add_(0, token_idx, ys)


class _StackedExpertWeight(nn.Module):
    """Holds one [E, rows, cols] parameter as ``weight`` (so its name ends in ``.weight``, as the
    checkpoint's per-expert names do after ``expert_params_mapping``)."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, loader) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = loader


class FusedMoE(nn.Module):
    """The routed experts of an MoE block: router logits in, combined expert output out.

    forward: x [N, hidden], router_logits [N, num_experts] -> [N, hidden] (``x.dtype``); with
    ``reduce_results=False`` and tp_size > 1 the output is this rank's partial sum.

    Raises:
        ValueError: ``intermediate_size`` is not divisible by the tensor-parallel size.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, reduce_results: bool = True) -> None:
        super().__init__()
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = get_tp_rank(), tp
        self.intermediate_size_per_rank = intermediate_size // tp
        inter = self.intermediate_size_per_rank
        self.w13 = _StackedExpertWeight((num_experts, 2 * inter, hidden_size), dtype, self.weight_loader)
        self.w2 = _StackedExpertWeight((num_experts, hidden_size, inter), dtype, self.weight_loader)
        self.loaded_shards: set[tuple[int, str]] = set()  # (expert, "w1" | "w2" | "w3") filled so far

    @staticmethod
    def expert_params_mapping(gate_name: str, up_name: str, down_name: str,
                              num_experts: int) -> list[tuple[str, str, tuple[int, str]]]:
        """(checkpoint fragment, parameter fragment, shard id) for every expert, in the form of
        ``LlamaForCausalLM.stacked_params``: ``experts.3.<gate_name>`` -> ``experts.w13`` with shard
        (3, "w1"), ``<up_name>`` -> (3, "w3"), ``<down_name>`` -> ``experts.w2`` (3, "w2")."""
        mapping = []
        for e in range(num_experts):
            mapping += [(f"experts.{e}.{gate_name}", "experts.w13", (e, "w1")),
                        (f"experts.{e}.{up_name}", "experts.w13", (e, "w3")),
                        (f"experts.{e}.{down_name}", "experts.w2", (e, "w2"))]
        return mapping

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: tuple[int, str]) -> None:
        """Copy this rank's slice of one expert's w1 (gate) / w3 (up) [I, H] or w2 (down) [H, I].

        Raises:
            ValueError: the slice's shape does not match the parameter.
        """
        expert, which = shard_id
        size = self.intermediate_size_per_rank
        start = self.tp_rank * size
        hidden, full = param.shape[1 if which == "w2" else 2], size * self.tp_size
        expected = [hidden, full] if which == "w2" else [full, hidden]
        if loaded_shape(loaded) != expected:  # a rank's slice alone could fit a wrong tensor
            raise ValueError(f"weight shape mismatch for expert {expert} {which}: expected {tuple(expected)}, "
                             f"got {tuple(loaded_shape(loaded))}")
        if which == "w2":
            _copy(param, param.data[expert], load_narrow(loaded, 1, start, size))
        else:
            offset = 0 if which == "w1" else size
            _copy(param, param.data[expert].narrow(0, offset, size), load_narrow(loaded, 0, start, size))
        self.loaded_shards.add((expert, which))

    def missing_shards(self) -> list[str]:
        """``"<expert>.<w1|w2|w3>"`` for every expert tensor not loaded yet."""
        return [f"{e}.{w}" for e in range(self.num_experts) for w in ("w1", "w2", "w3")
                if (e, w) not in self.loaded_shards]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.compute(x, topk_weights, topk_ids)

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, **kw: Any) -> torch.Tensor:
        """The experts on routing a model's own router chose (GLM-4.5's, ERNIE's, Llama 4's): x [N, H],
        topk_weights / topk_ids [N, k] -> [N, H]; ``kw`` goes to ``fused_experts``."""
        out = fused_experts(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids, **kw)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out


def verify_experts_loaded(model: nn.Module) -> None:
    """Raise ValueError naming the expert tensors a checkpoint lacked (a stacked parameter counts as
    loaded once any expert of it is, so the model's own missing-weight check cannot see these)."""
    missing = [f"{name}.{shard}" for name, m in model.named_modules() if isinstance(m, FusedMoE)
               for shard in m.missing_shards()]
    if missing:
        raise ValueError(f"checkpoint is missing expert weights (w1 = gate, w3 = up, w2 = down): {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) + routed ``experts`` + an optional ``shared_expert`` that every
    token also goes through, scaled by ``sigmoid(shared_expert_gate(x))`` when that gate exists
    (Qwen2-MoE). Module names follow the checkpoints (``mlp.gate``, ``mlp.experts``, ...).

    ``shared_expert`` must return this rank's partial sum (its row-parallel layer built with
    ``reduce_results=False``): the block all-reduces once, after the combine.

    forward: x [N, hidden] -> [N, hidden].
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, shared_expert: Optional[nn.Module] = None,
                 shared_expert_gate: bool = False) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, dtype,
                                reduce_results=False)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, dtype=dtype) \
            if shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return tensor_model_parallel_all_reduce(out)
