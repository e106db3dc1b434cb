"""A prompt with images -> ``MultiModalInputs``: the family's transformers processor (resize,
normalize, the placeholder tokens each image expands to) run once, in the process that tokenizes
(the API server's front end, or the offline engine), then per image its placeholder span, content
hash and tensors. The engine core only encodes (``multimodal/inputs.py`` says why)."""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence, Union

from pagedllm.models.registry import get_vision_tower_class
from pagedllm.multimodal.hasher import hash_image
from pagedllm.multimodal.inputs import MultiModalFeature, MultiModalInputs, TensorData
from pagedllm.multimodal.media import MediaError, MediaLimits, check_pil_image, limits_from

# Images one prompt may carry when --limit-mm-per-prompt does not say (vLLM's default is higher: these
# towers' token counts fill a small max_model_len quickly).
DEFAULT_IMAGE_LIMIT = 4


def image_limit(model_config: Any) -> int:
    """The most images a prompt of this engine may carry (0 for a text-only model)."""
    if not model_config.is_multimodal:
        return 0
    limits = model_config.limit_mm_per_prompt or {}
    unknown = set(limits) - {"image"}
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: unsupported modalities {sorted(unknown)} (only 'image')")
    n = limits.get("image", DEFAULT_IMAGE_LIMIT)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"limit_mm_per_prompt: 'image' must be a non-negative integer, got {n!r}")
    return n


class MultiModalProcessor:
    """The prompt side of a model's image input (built once per engine; the transformers processor is
    loaded on first use)."""

    def __init__(self, model_config: Any) -> None:
        self.model_config = model_config
        self.hf_config = model_config.multimodal_config
        arch = (getattr(model_config.hf_config, "text_only_of", None)
                or (self.hf_config.architectures or ["?"])[0])
        self.tower_cls = get_vision_tower_class(arch)
        self.limits: MediaLimits = limits_from(model_config)
        self.max_images = image_limit(model_config)
        self._processor: Optional[Any] = None
        self._lock = threading.Lock()  # (the API server may process two requests at once)

    @property
    def processor(self) -> Any:
        if self._processor is None:
            with self._lock:
                if self._processor is None:
                    self._processor = self.tower_cls.make_processor(self.model_config.model, self.hf_config)
        return self._processor

    @property
    def placeholder(self) -> str:
        """The text one image stands for in a prompt ("<image>", "<start_of_image>", ...)."""
        return self.tower_cls.image_placeholder(self.processor)

    def check_count(self, n: int) -> None:
        """Raise ValueError when a prompt may not carry ``n`` images."""
        if n > self.max_images:
            raise ValueError(f"{n} images in one prompt, more than the limit of {self.max_images} "
                             f"(--limit-mm-per-prompt)")

    def process(self, prompt: Union[str, Sequence[int]], images: Sequence[Any],
                add_special_tokens: bool = True) -> MultiModalInputs:
        """``prompt`` (text with one placeholder per image, or without any: they are then put before the
        text, as vLLM does for an LLM.generate prompt) and its PIL images -> MultiModalInputs.
        ``add_special_tokens``: False for a rendered chat (its template wrote them).
        Raises ValueError (a MediaError for a bad image) naming what is wrong."""
        if not isinstance(prompt, str):
            raise ValueError("a prompt with images must be text (its image placeholders are expanded by the "
                             "processor), not token ids")
        self.check_count(len(images))
        images = [check_pil_image(im, self.limits, f"image {i}") for i, im in enumerate(images)]
        mark = self.placeholder
        found = prompt.count(mark)
        if found == 0:
            prompt = mark * len(images) + prompt
        elif found != len(images):
            raise ValueError(f"the prompt has {found} image placeholder(s) {mark!r} for {len(images)} image(s)")
        try:
            out = self.tower_cls.process(self.processor, prompt, list(images), add_special_tokens)
        except (MediaError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - a processor that chokes on an image is a bad request
            raise MediaError(f"the image processor failed: {type(e).__name__}: {e}") from None
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        items = self.tower_cls.split_items(out, len(images))
        ranges = self.tower_cls.placeholder_ranges(self.hf_config, ids, items)
        features = [MultiModalFeature(identifier=hash_image(im), offset=off, length=n,
                                      data={k: TensorData.of(v) for k, v in item.items()}, is_embed=is_embed)
                    for im, item, (off, n, is_embed) in zip(images, items, ranges)]
        mm = MultiModalInputs(prompt_token_ids=ids, features=features)
        mrope = self.tower_cls.mrope_positions(self.hf_config, ids, items)
        if mrope is not None:
            mm.mrope_positions, mm.mrope_position_delta = TensorData.of(mrope[0]), int(mrope[1])
        return mm


def make_mm_processor(config: Any) -> Optional[MultiModalProcessor]:
    """The engine's processor of image prompts (None for a text-only model). Raises ValueError for a
    bad --limit-mm-per-prompt."""
    mc = config.model_config
    if not mc.is_multimodal:
        if mc.limit_mm_per_prompt and any(mc.limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt is set but {mc.architecture} is a text-only model")
        return None
    return MultiModalProcessor(mc)
