"""A target linear's LoRA slots, sharded like the base layer, applied by a forward hook.

The base layer is untouched (its quantization method, float / int8 / bf16, computes y = x W^T + b);
a forward hook adds the LoRA term of the step's tokens (``ops.lora_add_``) to its output. Slot
buffers per target: A [max_loras, S * R, in_per_rank], Bt [max_loras, R, out_per_rank] (B transposed:
the expand streams its rows; S slices: 3 for qkv, 2 for gate_up, else 1; R = --max-lora-rank; each
slice's B in its output columns, scale folded in); ``ranks_t`` [max_loras] int32 mirrors ``ranks``. The
CPU layer runner reads these tables in place (``platforms/cpu/layer_runner.py``: the pointers once, the
ranks each step), so a slot loaded or evicted here is what its next step computes with.

Tensor parallelism (as vLLM's ColumnParallelLinearWithLoRA / RowParallelLinearWithLoRA): a
column-parallel target keeps A whole and this rank's rows of B (per slice, with the base layer's
offsets: q by heads, k/v by KV heads, replicated where KV heads are fewer than ranks); a row-parallel
target keeps this rank's columns of A and B whole, and its shrink is all-reduced before the expand.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from pagedllm.lora.ops import LoRAStep, lora_add_
from pagedllm.lora.peft import LoRAAdapter


class LoRAContext:
    """The step's grouping, shared by every target's hook (None: no adapter in this step)."""

    def __init__(self) -> None:
        self.step: Optional[LoRAStep] = None


class LoRATarget:
    """slices: (PEFT target name, output offset, output size, first row of the unsharded B) per slice."""

    def __init__(self, module: nn.Module, name: str, slices: list[tuple[str, int, int, int]], row_parallel: bool,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device, ctx: LoRAContext) -> None:
        self.name = name
        self.prefix = name.rsplit(".", 1)[0]  # "layers.3.self_attn"
        self.slices = slices
        self.row_parallel = row_parallel
        self.tp_rank, self.tp_size = module.tp_rank, module.tp_size
        self.in_features = module.input_size
        out = sum(s[2] for s in slices)
        self.out_slices = [(off, size) for _, off, size, _ in slices]
        self.a = torch.zeros(max_loras, len(slices) * max_rank, self.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, max_rank, out, dtype=dtype, device=device)  # B transposed
        self.max_rank = max_rank
        self.ranks = [0] * max_loras  # rank of the adapter in each slot (0: none, or this target untouched)
        self.ranks_t = torch.zeros(max_loras, dtype=torch.int32)  # the same, for the CPU layer runner
        self.module = module
        self.ctx = ctx
        self.reduce = tensor_model_parallel_all_reduce if row_parallel and self.tp_size > 1 else None
        self.handle = module.register_forward_hook(self.hook)

    def set_slot(self, slot: int, adapter: Optional[LoRAAdapter]) -> None:
        """Put ``adapter``'s part for this target into ``slot`` (None or not targeted: zeros)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0
        self.ranks_t[slot] = 0
        if adapter is None:
            return
        r, used = adapter.rank, False
        for i, (pname, offset, size, start) in enumerate(self.slices):
            w = adapter.weights.get(f"{self.prefix}.{pname}")
            if w is None:
                continue
            a, b = w
            if self.row_parallel:
                a = a[:, self.tp_rank * self.in_features:(self.tp_rank + 1) * self.in_features]
            self.a[slot, i * self.max_rank:i * self.max_rank + r] = a.to(self.a.dtype)
            self.b[slot, :r, offset:offset + size] = (b[start:start + size] * adapter.scale).t().to(self.b.dtype)
            used = True
        if used:
            self.ranks[slot] = r
            self.ranks_t[slot] = r

    def hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        step = self.ctx.step
        if step is None or not any(self.ranks[s] for s in step.slots):
            return
        x = args[0]
        lora_add_(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), self.a, self.b, self.ranks,
                  self.out_slices, step, self.reduce)


def target_slices(module: nn.Module, name: str) -> Optional[tuple[list[tuple[str, int, int, int]], bool]]:
    """(slices, row_parallel) of a linear LoRA may target, None for any other module."""
    leaf = name.rsplit(".", 1)[-1]
    rank = getattr(module, "tp_rank", 0)
    if isinstance(module, QKVParallelLinear):
        q, kv = module.q_size, module.kv_size
        kv_start = (rank // module.num_kv_replicas) * kv
        return [("q_proj", 0, q, rank * q), ("k_proj", q, kv, kv_start), ("v_proj", q + kv, kv, kv_start)], False
    if isinstance(module, MergedColumnParallelLinear) and leaf == "gate_up_proj" and len(module.output_sizes) == 2:
        g, u = module.output_sizes
        return [("gate_proj", 0, g, rank * g), ("up_proj", g, u, rank * u)], False
    if isinstance(module, RowParallelLinear) and leaf in ("o_proj", "down_proj"):
        return [(leaf, 0, module.output_size, 0)], True
    if isinstance(module, ColumnParallelLinear) and leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        size = module.output_size
        return [(leaf, 0, size, rank * size)], False
    return None


def wrap_model(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device,
               ctx: LoRAContext) -> list[LoRATarget]:
    """Hook every target linear of the decoder layers (``layers.<i>.``) of ``model``."""
    targets = []
    for name, module in model.named_modules():
        if not name.startswith("layers.") and ".layers." not in name:
            continue
        found = target_slices(module, name)
        if found is not None:
            slices, row = found
            name = name[name.index("layers."):]
            targets.append(LoRATarget(module, name, slices, row, max_loras, max_rank, dtype, device, ctx))
    return targets
