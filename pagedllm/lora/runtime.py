"""A model runner's LoRA side: the hooked model, the slots' contents, the CPU cache of adapters.

``prepare(batch)`` before each forward pass: loads into a slot any adapter the step puts there that
is not already in it (from the CPU cache of ``--max-cpu-loras`` adapters, LRU, else from disk), then
groups the step's tokens by slot for every target's hook.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.lora.layers import LoRAContext, wrap_model
from pagedllm.lora.ops import make_step
from pagedllm.lora.peft import LoRAAdapter, adapter_summary, load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LoRABatch

logger = logging.getLogger("pagedllm")


class LoRARuntime:
    def __init__(self, model: nn.Module, hf_config: Any, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device, mode: str = "auto") -> None:
        self.hf_config = hf_config
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.mode = mode
        self.device = device
        self.ctx = LoRAContext()
        self.targets = wrap_model(model, max_loras, max_rank, dtype, device, self.ctx)
        self.cache: "OrderedDict[int, LoRAAdapter]" = OrderedDict()
        self.slot_ids: list[Optional[int]] = [None] * max_loras
        self.buffer_bytes = sum(t.a.numel() * t.a.element_size() + t.b.numel() * t.b.element_size()
                                for t in self.targets)

    def adapter(self, req: LoRARequest) -> LoRAAdapter:
        ad = self.cache.get(req.lora_int_id)
        if ad is None:
            ad = load_peft_adapter(req.lora_path, self.max_rank, self.hf_config)
            logger.info("LoRA adapter %r (id %d) loaded from %s: %s", req.lora_name, req.lora_int_id,
                        req.lora_path, adapter_summary(ad))
            self.cache[req.lora_int_id] = ad
            while len(self.cache) > self.max_cpu_loras:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(req.lora_int_id)
        return ad

    def load_slot(self, slot: int, req: LoRARequest) -> None:
        ad = self.adapter(req)
        for t in self.targets:
            t.set_slot(slot, ad)
        self.slot_ids[slot] = req.lora_int_id

    def remove(self, lora_int_id: int) -> None:
        """Forget an unloaded adapter: its CPU copy, and its slot's id (the slot is rewritten when reused)."""
        self.cache.pop(lora_int_id, None)
        self.slot_ids = [None if s == lora_int_id else s for s in self.slot_ids]

    def prepare(self, batch: Optional[LoRABatch]) -> None:
        if batch is None:
            self.ctx.step = None
            return
        for slot, req in batch.slot_adapters.items():
            if self.slot_ids[slot] != req.lora_int_id:
                self.load_slot(slot, req)
        self.ctx.step = make_step(batch.token_slots.to(self.device), self.mode)

    def finish(self) -> None:
        self.ctx.step = None
