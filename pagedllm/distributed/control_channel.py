"""The driver's calls to every rank: one pickled object broadcast from rank 0 over a gloo group.

The same two steps as ``torch.distributed.broadcast_object_list`` (the payload's length as one
int64, then its bytes as uint8), but the sender can go on without waiting for the receivers
(``broadcast_object_async``): with pipeline parallelism the driver starts the next batch while
later stages still run the previous one, and a rank busy with its stage must not hold it up
(vLLM gives its workers a shared-memory queue for the same reason). Every rank receives the calls
in the order they were sent (gloo matches collectives of a group by sequence).
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


class PendingBroadcast:
    """A sent call: ``wait()`` returns once every rank has received it (raises RuntimeError when a
    peer is gone). Holds the send buffers until then."""

    def __init__(self, works: list, buffers: tuple[torch.Tensor, ...]) -> None:
        self._works = works
        self._buffers = buffers

    def wait(self) -> None:
        while self._works:
            self._works[0].wait()
            self._works.pop(0)
        self._buffers = ()


def broadcast_object_async(obj: Any, group: Any) -> PendingBroadcast:
    """Send ``obj`` from global rank 0 to every rank of ``group`` (a gloo group, tensors on the
    CPU); returns at once."""
    data = pickle.dumps(obj)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    size = torch.tensor([len(data)], dtype=torch.long)
    works = [dist.broadcast(size, src=0, group=group, async_op=True),
             dist.broadcast(payload, src=0, group=group, async_op=True)]
    return PendingBroadcast(works, (size, payload))


def broadcast_object(obj: Any, group: Any) -> None:
    """``broadcast_object_async`` and wait until every rank has it."""
    broadcast_object_async(obj, group).wait()


def recv_broadcast_object(group: Any) -> Any:
    """On a rank other than 0: the next object rank 0 broadcast over ``group`` (blocks)."""
    size = torch.empty(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())
