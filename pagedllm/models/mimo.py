"""Xiaomi MiMo (``MiMoForCausalLM``; Xiaomi LLM-Core, 2025, "MiMo: Unlocking the Reasoning Potential of
Language Model"): Qwen2's layers, plus multi-token-prediction layers at ``model.mtp_layers.*`` that the
model itself does not hold (speculative decoding's ``mtp`` method loads them: ``models/mtp.py``). Its
config's ``model_type`` "mimo" names remote code; transformers' Qwen2 configuration reads it
(``checkpoint.REMOTE_CODE_MODEL_TYPES``)."""
from __future__ import annotations

from typing import Any, Iterable

from pagedllm.models.mtp import skip_mtp_layers
from pagedllm.models.qwen2 import Qwen2ForCausalLM


class MiMoForCausalLM(Qwen2ForCausalLM):
    mtp_layout = "mimo"

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(skip_mtp_layers(weights, self.config.num_hidden_layers))
