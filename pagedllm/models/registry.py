"""Model registry keyed by the ``architectures`` entry of a Hugging Face config.json."""
from __future__ import annotations

from typing import Any

from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(hf_config: Any, max_model_len: int) -> type:
    """The model class for ``hf_config``.

    Raises:
        ValueError: the architecture is not supported (the message lists those that are), or a
            sliding-window model would need a window shorter than ``max_model_len``.
    """
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            window = getattr(hf_config, "sliding_window", None)
            uses_window = getattr(hf_config, "use_sliding_window",
                                  arch in ("MistralForCausalLM", "MixtralForCausalLM"))
            if window and uses_window and window < max_model_len:
                raise ValueError(
                    f"{arch} uses sliding-window attention (sliding_window={window}), which pagedllm does not "
                    f"implement; set max_model_len <= {window} (got {max_model_len})")
            return MODEL_REGISTRY[arch]
    raise ValueError(f"model architecture {archs or '<none>'} is not supported; supported architectures: "
                     f"{', '.join(sorted(MODEL_REGISTRY))}")


def supported_architectures() -> list[str]:
    """The Hugging Face ``architectures`` names pagedllm can load, sorted."""
    return sorted(MODEL_REGISTRY)
