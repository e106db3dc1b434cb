"""The content hash of an image (vLLM's ``MultiModalHasher``, our own form): sha256 over its decoded
pixels (mode, width, height, raw bytes), so the same picture sent as a data: URL, a file or a PIL
image has one identifier, and two pictures differ unless their pixels are equal. The identifier keys
the encoder cache and enters the prefix-cache hashes of the blocks that hold the image's tokens."""
from __future__ import annotations

import hashlib
from typing import Any


def hash_image(image: Any) -> str:
    """Hex sha256 of a PIL image's mode, size and pixels."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()
