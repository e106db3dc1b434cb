"""A prompt's image side for families whose transformers processor class cannot be built here: their
``Qwen2VLProcessor`` / ``PixtralProcessor`` insist on torchvision (a video processor, a fast image
processor), which the CPU build of torch does not come with. Their PIL image processors work, so the
prompt is processed the same way in two steps: the image processor (resize, normalize, patch), then
each image's placeholder in the text replaced by the tokens the processor class would write
(``replace_image_token``), then the tokenizer.

A family subclasses ``ImagePromptProcessor`` (its image processor class, placeholder and expansion)
and mixes ``OwnPromptProcessor`` into its ``VisionTower`` (``models/vision.py``).
"""
from __future__ import annotations

import importlib
from typing import Any

import torch


class ImagePromptProcessor:
    """``__call__(text, images, add_special_tokens)`` -> the image processor's tensors and "input_ids"
    [1, L] with each ``image_token`` of ``text`` (in order) replaced by ``expansion(processed, i)``.

    Subclasses set ``image_token`` (what a prompt writes per image, expanded here), ``placeholder``
    (what the family's chat template writes per image: ``image_token`` with its delimiters) and
    ``image_processor_cls`` ("module:Class" of transformers' PIL image processor)."""

    image_token: str = ""
    placeholder: str = ""
    image_processor_cls: str = ""

    def __init__(self, image_processor: Any, tokenizer: Any, hf_config: Any) -> None:
        self.image_processor, self.tokenizer, self.hf_config = image_processor, tokenizer, hf_config

    @classmethod
    def load(cls, model_path: str, hf_config: Any) -> "ImagePromptProcessor":
        """The checkpoint's image processor (preprocessor_config.json) and tokenizer. Raises ValueError
        when either cannot be loaded."""
        from transformers import AutoTokenizer  # lazily: transformers, ~1 s to import

        module, name = cls.image_processor_cls.split(":")
        try:
            image_processor = getattr(importlib.import_module(module), name).from_pretrained(model_path)
            return cls(image_processor, AutoTokenizer.from_pretrained(model_path), hf_config)
        except Exception as e:  # noqa: BLE001 - missing/bad preprocessor_config.json or tokenizer
            raise ValueError(f"cannot load the image processor of {model_path}: {type(e).__name__}: {e}") from None

    def image_kwargs(self) -> dict:
        """Keywords the image processor is called with (the family's processor class passes them)."""
        return {}

    def expansion(self, processed: dict[str, torch.Tensor], i: int) -> str:
        """The text image ``i``'s placeholder becomes."""
        raise NotImplementedError

    def __call__(self, text: str, images: list, add_special_tokens: bool = True) -> dict[str, torch.Tensor]:
        out = dict(self.image_processor(images=images, return_tensors="pt", **self.image_kwargs()))
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} {self.image_token} placeholder(s) for "
                             f"{len(images)} image(s)")
        text = pieces[0] + "".join(self.expansion(out, i) + rest for i, rest in enumerate(pieces[1:]))
        out["input_ids"] = self.tokenizer([text], return_tensors="pt",
                                          add_special_tokens=add_special_tokens)["input_ids"]
        return out


class OwnPromptProcessor:
    """A ``VisionTower`` mixin: the prompt side from ``prompt_processor`` (an ImagePromptProcessor
    subclass) instead of transformers' processor class."""

    prompt_processor: type[ImagePromptProcessor] = ImagePromptProcessor

    @classmethod
    def make_processor(cls, model_path: str, hf_config: Any) -> ImagePromptProcessor:
        return cls.prompt_processor.load(model_path, hf_config)

    @classmethod
    def image_placeholder(cls, processor: Any) -> str:
        return processor.placeholder

    @classmethod
    def process(cls, processor: Any, text: str, images: list, add_special_tokens: bool = True
                ) -> dict[str, torch.Tensor]:
        return processor(text, images, add_special_tokens)
