"""Images from where a request names them: a PIL image (offline API), a ``data:`` URL (base64 PNG,
JPEG, WebP, GIF, BMP), a ``file://`` URL or path under ``--allowed-local-media-path``, or an
``http(s)://`` URL fetched only under ``--allow-remote-media``. Every failure is a ``MediaError``
(a ValueError: the API answers 400) with a one-line reason; nothing here raises anything else for
bad bytes (the fuzz test in ``tests/test_vision_inputs.py`` holds that).

Limits: the encoded size (``MAX_IMAGE_BYTES``) and the decoded pixel count (``MAX_IMAGE_PIXELS``, also
PIL's decompression-bomb guard), both checked before the image is decoded in full.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm import envs

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class MediaError(ValueError):
    """An image that cannot be used; the message names why."""


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how large they may be.

    allowed_local_media_path: a folder whose files ``file://`` URLs may name (None: no local files).
    allow_remote_media: fetch http(s) URLs.
    max_bytes: encoded bytes of one image; max_pixels: width x height of one decoded image.
    fetch_timeout_s: seconds a remote fetch may take.
    """
    allowed_local_media_path: Optional[str] = None
    allow_remote_media: bool = False
    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    fetch_timeout_s: float = 10.0


def decode_image(data: bytes, limits: MediaLimits, what: str = "image") -> Any:
    """Encoded bytes -> an RGB PIL image (fully decoded). Raises MediaError."""
    from PIL import Image  # lazily: Pillow, only for image requests

    if len(data) > limits.max_bytes:
        raise MediaError(f"{what} is {len(data)} bytes, more than the limit of {limits.max_bytes}")
    if not data:
        raise MediaError(f"{what} is empty")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.UnidentifiedImageError:
        raise MediaError(f"{what} is not an image in a supported format ({', '.join(FORMATS)})") from None
    except Exception as e:  # noqa: BLE001 - a malformed header can raise anything inside PIL
        raise MediaError(f"{what} cannot be decoded: {type(e).__name__}: {e}") from None
    return _checked(img, limits, what)


def _checked(img: Any, limits: MediaLimits, what: str) -> Any:
    w, h = img.size
    if w <= 0 or h <= 0:
        raise MediaError(f"{what} has no pixels ({w}x{h})")
    if w * h > limits.max_pixels:
        raise MediaError(f"{what} is {w}x{h} = {w * h} pixels, more than the limit of {limits.max_pixels}")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data shows only once the pixels are read
        raise MediaError(f"{what} cannot be decoded: {type(e).__name__}: {e}") from None


def check_pil_image(img: Any, limits: MediaLimits, what: str = "image") -> Any:
    """A caller's PIL image, size-checked and in RGB. Raises MediaError for anything else."""
    from PIL import Image  # lazily: Pillow, only for image requests

    if not isinstance(img, Image.Image):
        raise MediaError(f"{what} must be a PIL.Image.Image, got {type(img).__name__}")
    return _checked(img, limits, what)


def load_image_url(url: str, limits: MediaLimits, what: str = "image_url") -> Any:
    """The image a URL names (data:, file://, http(s)://). Raises MediaError."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{what} must be a non-empty URL string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, what), limits, what)
    if scheme == "file":
        return decode_image(_local_bytes(urllib.parse.unquote(urllib.parse.urlparse(url).path), limits, what),
                            limits, what)
    if scheme in ("http", "https"):
        if not limits.allow_remote_media:
            raise MediaError(f"{what}: remote URLs are not fetched (serve with --allow-remote-media; "
                             f"offline: LLM(..., allow_remote_media=True)); "
                             f"send the image as a data: URL")
        return decode_image(_fetch(url, limits, what), limits, what)
    raise MediaError(f"{what}: unsupported URL scheme {scheme or url[:20]!r} (data:, file:// or http(s)://)")


def _data_url_bytes(url: str, what: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"{what}: a data: URL needs a ',' before its payload")
    media_type = head[5:].split(";")[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"{what}: unsupported media type {media_type!r} (an image/* data URL)")
    if ";base64" not in head.lower():
        raise MediaError(f"{what}: only base64 data: URLs are supported")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what}: the data: URL's payload is not valid base64") from None


def _local_bytes(path: str, limits: MediaLimits, what: str) -> bytes:
    root = limits.allowed_local_media_path
    if not root:
        raise MediaError(f"{what}: local files are not served (serve with --allowed-local-media-path DIR; "
                         f"offline: LLM(..., allowed_local_media_path=DIR))")
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise MediaError(f"{what}: {path} is outside --allowed-local-media-path")
    try:
        size = os.path.getsize(real)
        if size > limits.max_bytes:
            raise MediaError(f"{what} is {size} bytes, more than the limit of {limits.max_bytes}")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise MediaError(f"{what}: cannot read {path}: {e.strerror or e}") from None


def _fetch(url: str, limits: MediaLimits, what: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as resp:  # noqa: S310 - scheme checked
            data = resp.read(limits.max_bytes + 1)
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 - HTTP errors, timeouts, refused connections
        raise MediaError(f"{what}: cannot fetch {url}: {type(e).__name__}: {e}") from None
    if len(data) > limits.max_bytes:
        raise MediaError(f"{what} is more than the limit of {limits.max_bytes} bytes")
    return data


def limits_from(model_config: Any) -> MediaLimits:
    """The limits ``ModelConfig`` carries (its fields of the same names)."""
    return MediaLimits(allowed_local_media_path=getattr(model_config, "allowed_local_media_path", None),
                       allow_remote_media=bool(getattr(model_config, "allow_remote_media", False)),
                       max_bytes=envs.PAGEDLLM_MAX_IMAGE_BYTES, max_pixels=envs.PAGEDLLM_MAX_IMAGE_PIXELS,
                       fetch_timeout_s=envs.PAGEDLLM_IMAGE_FETCH_TIMEOUT_S)
