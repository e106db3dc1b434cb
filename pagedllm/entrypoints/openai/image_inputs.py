"""Images of an API request (chat ``image_url`` parts, Responses ``input_image`` parts): loaded under the
server's media settings, counted against --limit-mm-per-prompt, processed with the prompt text into
the engine's ``MultiModalInputs``. Every failure is a ``RequestError`` (400) naming the request part;
the loading and processing run in a worker thread (decoding and resizing are CPU work)."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.multimodal.chat import load_part_image
from pagedllm.multimodal.media import limits_from


def image_placeholder(engine: Any, first_param: str, kind: str) -> str:
    """The model's image placeholder text; RequestError naming ``first_param`` for a text-only model."""
    mm = getattr(engine, "mm_processor", None)
    if mm is None:
        if kind == "input_image":  # (the Responses API's wording)
            raise RequestError(f"This model is text-only: it cannot take image input (input content part of type "
                               f"{kind!r}).", first_param)
        raise RequestError(f"This model accepts only text, so a message content part of type {kind!r} cannot be "
                           f"used.", first_param)
    return mm.placeholder


async def image_prompt(engine: Any, parts: list[tuple[str, str]],
                       render: Callable[[str], str]) -> tuple[list[int], dict]:
    """``parts``: (request parameter path, image URL) in prompt order; ``render(placeholder)``: the prompt
    text with one placeholder per image. Returns (prompt token ids, the engine prompt dict)."""
    mm = engine.mm_processor
    try:
        mm.check_count(len(parts))
    except ValueError as e:
        raise RequestError(str(e), parts[mm.max_images][0] if mm.max_images < len(parts) else None) from None
    limits = limits_from(engine.config.model_config)

    def work() -> tuple[list[int], dict]:
        images = []
        for where, url in parts:
            try:
                images.append(load_part_image(url, limits, where))
            except ValueError as e:
                raise RequestError(str(e), where) from None
        text = render(mm.placeholder)
        try:
            _, ids, mm_inputs = engine.preprocess_prompt(
                {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False})
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e), parts[0][0]) from None
        return ids, {"mm_inputs": mm_inputs}

    return await asyncio.to_thread(work)
