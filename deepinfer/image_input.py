"""Images as callers give them, decoded under the engine's limits; every problem one line naming the fix.

An image is a PIL image, its encoded bytes, a ``data:image/...;base64,...`` URI,
a local file path (or ``file://`` URL), or an http(s) URL, which is fetched only
when ``allow_remote_images`` is set (with a timeout and the byte cap). Limits
guard the engine: images per prompt, encoded bytes, decoded pixels (a small file
can claim a huge canvas: the size is checked from the header, before decoding).
Which family reads the decoded image, and how, is the family's business.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .config import EngineConfig
from .sampling_params import InvalidRequestError

#: what ``multi_modal_data["image"]`` may hold, one image or a list of them
ImageSource = Any


class ImageInputError(InvalidRequestError):
    """An image that cannot be used: too many, too large, undecodable, unreachable."""


@dataclass(frozen=True)
class ImageLimits:
    """What one prompt's images may be (``EngineConfig``'s image fields)."""

    max_images: int = 16
    max_bytes: int = 20 << 20
    max_pixels: int = 64 << 20
    allow_remote: bool = False
    fetch_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, config: EngineConfig) -> "ImageLimits":
        return cls(config.max_images_per_prompt, config.max_image_bytes, config.max_image_pixels,
                   config.allow_remote_images, config.image_fetch_timeout_s)


def image_list(value: ImageSource) -> list[ImageSource]:
    """``multi_modal_data["image"]`` as a list: one image, or a list / tuple of them."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_count(n: int, limits: ImageLimits) -> None:
    """Refuse a prompt with more images than ``max_images_per_prompt``."""
    if n > limits.max_images:
        raise ImageInputError(
            f"the prompt has {n} images but max_images_per_prompt is {limits.max_images}; "
            "send fewer images or raise max_images_per_prompt (--max-images-per-prompt)"
        )


def load_images(sources: Sequence[ImageSource], limits: ImageLimits) -> list[Any]:
    """Every image of one prompt, decoded (``load_image``), after the count check."""
    check_count(len(sources), limits)
    return [load_image(s, limits) for s in sources]


def load_image(source: ImageSource, limits: ImageLimits) -> Any:
    """The decoded ``PIL.Image.Image`` of ``source`` (its pixels loaded, its mode as stored)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, limits)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode(bytes(source), limits)
    if isinstance(source, Path):
        return decode(_read_file(source, limits), limits)
    if not isinstance(source, str):
        raise ImageInputError(
            f"an image is a PIL image, bytes, a data URI or a file path, not {type(source).__name__}; pass one of those"
        )
    if source.startswith("data:"):
        return decode(_data_uri(source, limits), limits)
    if source.startswith(("http://", "https://")):
        return decode(_fetch(source, limits), limits)
    if "://" in source[:16] and not source.startswith("file://"):
        raise ImageInputError(f"image URL {_short(source)} has a scheme this engine does not read; send a data URI, a file path or http(s)")
    return decode(_read_file(Path(source.removeprefix("file://")), limits), limits)


def decode(data: bytes, limits: ImageLimits) -> Any:
    """Decode encoded image bytes, checking their size and the canvas the header declares before decoding."""
    from PIL import Image

    _check_bytes(len(data), limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel cap decides
            image = Image.open(io.BytesIO(data))
            _check_pixels(image.width, image.height, limits)
            image.load()
    except ImageInputError:
        raise
    except Image.DecompressionBombError:
        raise ImageInputError(
            "the image declares more pixels than Pillow decodes (a decompression bomb); send a smaller image"
        ) from None
    except Image.UnidentifiedImageError:
        raise ImageInputError("the image data is in no format Pillow reads; send a PNG, JPEG, WebP, GIF or BMP image") from None
    except Exception as exc:  # Pillow raises format-specific errors of many kinds
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageInputError(f"the image could not be decoded ({reason}); send a PNG, JPEG, WebP, GIF or BMP image") from None
    return image


def _check_bytes(n: int, limits: ImageLimits) -> None:
    if n > limits.max_bytes:
        raise ImageInputError(
            f"the image is {n} bytes, over max_image_bytes ({limits.max_bytes}); send a smaller image or raise --max-image-bytes"
        )


def _check_pixels(width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise ImageInputError(
            f"the image is {width} x {height} = {width * height} pixels, over max_image_pixels ({limits.max_pixels}); "
            "send a smaller image or raise --max-image-pixels"
        )
    if width < 1 or height < 1:
        raise ImageInputError(f"the image is {width} x {height} pixels; send an image with at least one pixel")


def _short(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def _data_uri(uri: str, limits: ImageLimits) -> bytes:
    """The bytes of ``data:image/<type>;base64,<payload>``."""
    head, comma, payload = uri.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise ImageInputError(f"image data URI {_short(uri, 40)} is not base64; send data:image/<type>;base64,<data>")
    _check_bytes(len(payload) * 3 // 4 - 2, limits)  # before decoding: the payload's decoded size, padding aside
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("the image data URI's payload is not valid base64; encode the image with standard base64") from None


def _read_file(path: Path, limits: ImageLimits) -> bytes:
    try:
        if not path.is_file():
            raise ImageInputError(f"image file {_short(str(path))} does not exist; give an existing file, a data URI, bytes or a PIL image")
        _check_bytes(path.stat().st_size, limits)
        return path.read_bytes()
    except OSError as exc:
        raise ImageInputError(
            f"image file {_short(str(path))} cannot be read ({exc.strerror or exc}); check the path and its permissions"
        ) from None


def _fetch(url: str, limits: ImageLimits) -> bytes:
    """Download an http(s) image, when allowed: at most ``max_bytes``, within ``fetch_timeout_s``."""
    if not limits.allow_remote:
        raise ImageInputError(
            f"remote image URLs are not fetched ({_short(url)}); send a data URI or a local file, "
            "or start the engine with --allow-remote-images"
        )
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:  # noqa: S310 - http(s) only, checked above
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ImageInputError(f"fetching the image at {_short(url)} failed ({reason}); check the URL or send a data URI") from None
    _check_bytes(len(data), limits)
    return data
