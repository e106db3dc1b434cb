"""Image parts of chat messages (OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``, and vLLM's
offline ``{"type": "image_pil", "image_pil": PIL.Image}``): each is replaced in place by a text part
holding the model's image placeholder (which the chat template then renders as text, and the processor
expands), and the images are returned in order."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.multimodal.media import MediaError, MediaLimits, check_pil_image, load_image_url

IMAGE_PART_TYPES = ("image_url", "image_pil")


def split_chat_images(messages: list, placeholder: Optional[str], limits: MediaLimits) -> tuple[list, list]:
    """(messages with image parts as placeholder text, the images loaded, in order). ``placeholder``
    None: the model takes no images. Raises ValueError (MediaError) naming the part
    (``messages[i].content[j]``) that cannot be used."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(p)
                continue
            where = f"messages[{i}].content[{j}]"
            if placeholder is None:
                raise ValueError(f"{where}: this model accepts only text, so a content part of type {kind!r} "
                                 f"cannot be used")
            if kind == "image_url":
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_image_url(url, limits, where))
            else:
                images.append(check_pil_image(p.get("image_pil"), limits, where))
            parts.append({"type": "text", "text": placeholder})
        out.append({**m, "content": parts})
    return out, images


def load_part_image(url: Any, limits: MediaLimits, where: str) -> Any:
    """One image URL of a request part (the API server's path); MediaError names ``where``."""
    if not isinstance(url, str):
        raise MediaError(f"{where}: the image URL must be a string")
    return load_image_url(url, limits, where)
