"""Which files a model path names, and its config and tokenizer, with one clear error when they are bad.

A model is a Hugging Face folder (config.json + *.safetensors + tokenizer files), a ``.gguf`` file, or
a folder without config.json holding exactly one ``.gguf`` (see ``models/gguf.py``). Every failure is a
``ValueError`` with a one-line message: ``pagedllm serve`` prints it and exits 1, ``LLM`` raises it.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Iterator

from pagedllm.models.gguf import find_gguf_file, load_gguf_config, load_gguf_tokenizer, one_line
from pagedllm.models.registry import supported_architectures, vision_architectures
from pagedllm.models.vision import VISION_PREFIXES

# A Hugging Face hub id: "name" or "owner/name" (letters, digits, "-", "_", ".").
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_like_local_path(model: str) -> bool:
    """True for a string that cannot be a hub id: "/x", "./x", "~/x", "a/b/c", "x.gguf", ..."""
    return (not _HUB_ID.fullmatch(model) or model.startswith((".", "~"))
            or model.lower().endswith((".gguf", ".safetensors", ".json")))


def local_model_path(path: str) -> str:
    """The GGUF file ``path`` names (itself, or the only .gguf in a folder without config.json),
    else ``path`` itself. Raises ValueError when ``path`` does not exist."""
    if not os.path.exists(path):
        raise ValueError(f"model path {path} does not exist")
    return find_gguf_file(path) or path


# model_type of checkpoints whose config.json names remote code (``auto_map``) for a configuration
# transformers has under another name: read with that class, no code run (Kimi K2 is DeepSeek-V3).
REMOTE_CODE_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


def load_hf_config(path: str) -> Any:
    """The transformers config of a local model (a folder with config.json, or a GGUF file).

    Raises:
        ValueError: the path is neither, config.json is unreadable, or transformers does not know its type.
    """
    gguf_file = find_gguf_file(path)
    if gguf_file:
        return load_gguf_config(gguf_file)
    if os.path.isfile(path):
        raise ValueError(f"{path} is neither a GGUF file nor a model folder; pass a Hugging Face model folder "
                         f"(config.json + *.safetensors) or a .gguf file")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise ValueError(f"{path} has no config.json and no .gguf file, so it is not a model folder; pass a "
                         f"Hugging Face model folder (config.json + *.safetensors) or a .gguf file")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {config_file}: {one_line(e)}") from None
    from transformers import AutoConfig  # lazily: transformers, ~1 s to import

    try:
        same_as = REMOTE_CODE_MODEL_TYPES.get(raw.get("model_type")) if isinstance(raw, dict) else None
        if same_as:  # the config class is remote code; transformers' own class reads the same fields
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            config = AutoConfig.for_model(same_as, **fields)
        else:
            config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - unknown model_type, bad values, ...
        raise ValueError(f"cannot load the config of {path} ({one_line(e)}); supported architectures: "
                         f"{', '.join(supported_architectures())}") from None
    return text_only_config(config)


# Image-text checkpoints served for text: architecture -> its language model's architecture. Their
# config's text_config is that model's; its weights sit under a prefix beside the vision tower's.
# Qwen2-VL / Qwen2.5-VL: for text alone their M-RoPE is plain RoPE (the three position streams agree).
# LLaVA: the language model named by its text_config's model_type.
TEXT_ONLY = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
             "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
             "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
             "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
             "Mistral3ForConditionalGeneration": None,  # Mistral Small 3.1/3.2: mistral; Ministral 3: ministral3
             "LlavaForConditionalGeneration": None}
_TEXT_ARCH_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "ministral": "MinistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_only_config(config: Any) -> Any:
    """``config``, or for an image-text checkpoint (TEXT_ONLY) its text model's config, with
    ``architectures`` naming the text model and ``text_only_of`` the checkpoint's architecture (the
    loader then maps the language model's weight names and leaves the vision tower's)."""
    arch = next((a for a in getattr(config, "architectures", None) or [] if a in TEXT_ONLY), None)
    if arch is None or getattr(config, "text_config", None) is None:
        return config
    text = config.text_config
    text_arch = TEXT_ONLY[arch] or _TEXT_ARCH_OF_TYPE.get(getattr(text, "model_type", None))
    if text_arch is None:
        raise ValueError(f"{arch} with a {getattr(text, 'model_type', None)!r} language model is not supported; its "
                         f"text model may be one of: {', '.join(sorted(_TEXT_ARCH_OF_TYPE))}")
    text.architectures = [text_arch]
    text.text_only_of = arch
    # The whole config, where the architecture's vision tower is served (models/registry.py): the tower
    # is built from it and images are taken (``ModelConfig.is_multimodal``).
    text.multimodal_config = config if arch in vision_architectures() else None
    tied = config.to_dict().get("tie_word_embeddings")  # kept on the outer config by some (Qwen2.5-VL)
    if tied is not None:
        text.tie_word_embeddings = tied
    return text


def text_only_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """An image-text checkpoint's language-model weights under the text model's names; the vision
    tower's and the projector's are left out."""
    for name, w in weights:
        if name.startswith(VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, w


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a local folder, a GGUF file (from its metadata) or a hub id.

    Raises:
        ValueError: no tokenizer can be built from ``path``.
    """
    gguf_file = find_gguf_file(path) if os.path.exists(path) else None
    if gguf_file:
        return load_gguf_tokenizer(gguf_file)
    from transformers import AutoTokenizer  # lazily: transformers, ~1 s to import

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load a tokenizer from {path} ({one_line(e)}); pass one with --tokenizer") from None
