"""Tensor- and pipeline-parallel process group state and collectives (no-ops at size 1).

One process per rank; ``init_tensor_parallel`` joins a ``torch.distributed`` group (NCCL on
CUDA, gloo on a CPU). Layers ask ``get_tp_rank()``/``get_tp_size()`` for their shard.

With pipeline parallelism (``init_model_parallel``) the world is TP x PP ranks laid out as in
vLLM: global rank = pp_rank * tp_size + tp_rank, so each stage's TP group is a run of
consecutive ranks (one node, when a stage fits on one), and a stage's rank r talks to rank
r +- tp_size of its neighbour stages. Models ask ``get_pp_layer_range(num_layers)`` for the
layers they own (``is_first_pp_rank``: embedding; ``is_last_pp_rank``: final norm + LM head).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None  # None: the default group (the whole world is one TP group)
_PP_RANK = 0
_PP_SIZE = 1


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


def get_pp_rank() -> int:
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def is_first_pp_rank() -> bool:
    return _PP_RANK == 0


def is_last_pp_rank() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage ``pp_rank`` owns: an even split, the earlier stages
    one layer short when it does not divide (the last stage also runs the LM head)."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def get_pp_layer_range(num_layers: int) -> tuple[int, int]:
    return pp_layer_range(num_layers, _PP_RANK, _PP_SIZE)


def init_model_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str,
                        timeout: Optional[timedelta] = None) -> None:
    """Join a world of ``tp_size * pp_size`` ranks and build the TP group of each stage (every
    rank creates every group, as ``new_group`` requires). ``timeout`` bounds the rendezvous and
    every collective and point-to-point transfer."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE
    world = tp_size * pp_size
    init_tensor_parallel(rank, world, init_method, backend, timeout)
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE = rank % tp_size, tp_size, rank // tp_size, pp_size
    _TP_GROUP = None
    if pp_size > 1 and tp_size > 1:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        for p in range(pp_size):
            g = dist.new_group(list(range(p * tp_size, (p + 1) * tp_size)), **kwargs)
            if p == _PP_RANK:
                _TP_GROUP = g


def pp_send(x: torch.Tensor, dst_stage: int) -> None:
    """Send ``x`` to this TP rank's peer on stage ``dst_stage`` (blocking, torch.distributed)."""
    dist.send(x.contiguous(), dst_stage * _TP_SIZE + _TP_RANK)


def pp_recv(shape: tuple, dtype: torch.dtype, device, src_stage: int) -> torch.Tensor:
    """Receive a tensor of ``shape``/``dtype`` from this TP rank's peer on stage ``src_stage``."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src_stage * _TP_SIZE + _TP_RANK)
    return x


def set_tp_state(rank: int, world_size: int) -> None:
    """Set rank/size without a process group (tests of sharding logic)."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size


def get_pp_state() -> tuple[int, int]:
    return _PP_RANK, _PP_SIZE


def set_pp_state(rank: int, size: int) -> None:
    """Set the pipeline rank/size without a process group (a single-process model builds all layers)."""
    global _PP_RANK, _PP_SIZE
    _PP_RANK, _PP_SIZE = rank, size


def destroy_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE = 0, 1, None, 0, 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place; returns ``x``."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise max of ``x`` over the TP group, in place; returns ``x``."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's ``x`` along ``dim`` (rank order)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
