"""Model registry keyed by the ``architectures`` entry of a Hugging Face config.json.

Each entry maps an architecture name to (module under ``pagedllm.models``, class name); the module
is imported on first use, so a family's imports cost nothing until a model of it is loaded (as
vLLM's ``model_executor/models/registry.py`` does). A model class may define
``verify_config(hf_config, max_model_len)`` to refuse a configuration it cannot serve.
"""
from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module in pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "MiMoForCausalLM": ("mimo", "MiMoForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("granite_moe", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granite_moe", "GraniteMoeSharedForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite_moe", "GraniteMoeHybridForCausalLM"),  # attention layers only
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "MinistralForCausalLM": ("llama", "MistralForCausalLM"),  # layer_types (all sliding with a window)
    "Ministral3ForCausalLM": ("ministral3", "Ministral3ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo3", "Olmo3ForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "SeedOssForCausalLM": ("llama", "LlamaForCausalLM"),  # biases: attention_bias (q/k/v), attention_out_bias
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "GlmForCausalLM": ("glm4", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "Cohere2ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan", "HunYuanDenseV1ForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    # Base models (no LM head), as embedding checkpoints are saved: for --runner pooling
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("llama", "MistralForCausalLM"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),  # also Kimi K2
    "Glm4MoeLiteForCausalLM": ("deepseek_v2", "Glm4MoeLiteForCausalLM"),
    "MiniCPM3ForCausalLM": ("deepseek_v2", "MiniCPM3ForCausalLM"),
}


# Image-text architecture -> (module in pagedllm.models, class name) of its vision tower + projector
# (a ``models/vision.py`` VisionTower); its language model is the text model ``models/checkpoint.py``
# maps the architecture to. An image-text architecture without an entry here is served for text only.
_VISION_TOWERS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("llava_vision", "LlavaVisionTower"),
    "Gemma3ForConditionalGeneration": ("gemma3_vision", "Gemma3VisionTower"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl_vision", "Qwen2VLVisionTower"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl_vision", "Qwen2VLVisionTower"),
    "Mistral3ForConditionalGeneration": ("pixtral_vision", "PixtralVisionTower"),
}


def vision_architectures() -> list[str]:
    """The image-text architectures whose images are served (a vision tower is registered), sorted."""
    return sorted(_VISION_TOWERS)


def get_vision_tower_class(arch: str) -> type:
    """The VisionTower class of image-text architecture ``arch``. Raises KeyError for one without."""
    module, name = _VISION_TOWERS[arch]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), name)


def supported_architectures() -> list[str]:
    """Names of every registered architecture (``architectures`` in config.json), sorted."""
    return sorted(_MODELS)


def _load_class(arch: str) -> type:
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), name)


def get_model_class(hf_config: Any, max_model_len: int) -> type:
    """The model class for ``hf_config`` (the first of its ``architectures`` that is registered).

    Raises:
        ValueError: the architecture is not supported (the message lists those that are), or the
            model class refuses the configuration (its ``verify_config`` says why).
    """
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            cls = _load_class(arch)
            verify = getattr(cls, "verify_config", None)
            if verify is not None:
                verify(hf_config, max_model_len)
            return cls
    raise ValueError(f"model architecture {archs or '<none>'} is not supported; supported architectures: "
                     f"{', '.join(supported_architectures())}")
