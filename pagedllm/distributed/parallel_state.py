"""Tensor-parallel process group state and collectives (no-ops when the TP size is 1).

One process per rank; ``init_tensor_parallel`` joins a ``torch.distributed`` group (NCCL on
CUDA, gloo on a CPU). Layers ask ``get_tp_rank()``/``get_tp_size()`` for their shard.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout: Optional[timedelta] = None) -> None:
    """Join the default process group as ``rank`` of ``world_size`` (all ranks form the TP group).
    ``timeout`` bounds the rendezvous and every collective (a hung peer raises instead of hanging)."""
    global _TP_RANK, _TP_SIZE
    if world_size > 1 and not dist.is_initialized():
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                **kwargs)
    _TP_RANK, _TP_SIZE = rank, world_size


def set_tp_state(rank: int, world_size: int) -> None:
    """Set rank/size without a process group (tests of sharding logic)."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size


def destroy_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place; returns ``x``."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's ``x`` along ``dim`` (rank order)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
