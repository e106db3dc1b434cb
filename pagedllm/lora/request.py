"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

``LoRARequest(lora_name, lora_int_id, lora_path)``: the name a client uses (the API's ``model``), a
positive integer id unique per adapter (slots, the CPU cache and prefix-cache hashes are keyed by it),
and a folder holding PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``. Two requests are
the same adapter when their names are equal (vLLM's rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = field(default=None)
    long_lora_max_len: Optional[int] = field(default=None)  # vLLM's field; unused here

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
