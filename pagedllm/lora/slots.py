"""The engine's LoRA slot table: which adapter sits in which of the ``--max-loras`` slots, and each
step's per-token slot ids (part of the flat batch, ``ModelInput.lora``).

A step uses at most ``max_loras`` adapters (the scheduler admits no request whose adapter would make
more); an adapter not in a slot takes a free one or evicts the least recently used adapter not in
this step (LRU, as vLLM's LRUCacheWorkerLoRAManager). Every rank loads what ``slot_adapters`` names
into the same slots, so ranks agree without talking.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from pagedllm.lora.request import LoRARequest


@dataclass
class LoRABatch:
    """``token_slots`` [N] int64: the slot of each token of the flat batch, -1 for the base model;
    ``slot_adapters``: slot -> the adapter that must be in it for this step (picklable)."""
    token_slots: torch.Tensor
    slot_adapters: dict[int, LoRARequest]


class LoRASlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: "OrderedDict[int, int]" = OrderedDict()  # adapter id -> slot, least recent first
        self.free = list(range(max_loras - 1, -1, -1))

    def _slot(self, lora: LoRARequest, in_step: set[int]) -> int:
        aid = lora.lora_int_id
        slot = self.slot_of.get(aid)
        if slot is not None:
            self.slot_of.move_to_end(aid)
            return slot
        if not self.free:
            victim = next((a for a in self.slot_of if a not in in_step), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            self.free.append(self.slot_of.pop(victim))
        slot = self.slot_of[aid] = self.free.pop()
        return slot

    def forget(self, lora_int_id: int) -> None:
        """Free an unloaded adapter's slot (ranks reload whatever a later step puts there)."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free.append(slot)

    def batch(self, seqs: Iterable[tuple[Any, int]], device: str = "cpu") -> Optional[LoRABatch]:
        """``seqs``: (request, number of tokens) in the flat batch's order; a request's adapter is its
        ``lora_request`` (None: the base model). None when no token uses an adapter."""
        seqs = list(seqs)
        loras = [getattr(r, "lora_request", None) for r, _ in seqs]
        if not any(loras):
            return None
        in_step = {lr.lora_int_id for lr in loras if lr is not None}
        slots: list[int] = []
        slot_adapters: dict[int, LoRARequest] = {}
        for lr, (_, n) in zip(loras, seqs):
            if lr is None:
                slots.extend([-1] * n)
                continue
            s = self._slot(lr, in_step)
            slot_adapters[s] = lr
            slots.extend([s] * n)
        return LoRABatch(torch.tensor(slots, dtype=torch.long, device=device), slot_adapters)
