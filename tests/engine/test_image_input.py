"""Images as callers give them: data URIs, files, bytes, PIL images; remote URLs refused unless allowed; the
limits (count, bytes, pixels) and undecodable data, each a one-line error naming the fix."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from deepinfer.config import load_config
from deepinfer.engine_flags import add_engine_arguments, engine_overrides
from deepinfer.image_input import ImageInputError, ImageLimits, load_image, load_images
from tests.helpers.tiny_images import data_uri, gradient_image, png_bytes

LIMITS = ImageLimits()


def _same(a, b) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))


def test_every_local_form_decodes_to_the_same_pixels(tmp_path):
    image = gradient_image(7, 5)
    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(image))
    for source in (image, png_bytes(image), bytearray(png_bytes(image)), data_uri(image), str(path), path, f"file://{path}"):
        assert _same(load_image(source, LIMITS), image), type(source)


def test_remote_urls_are_refused_unless_allowed():
    with pytest.raises(ImageInputError, match=r"^remote image URLs are not fetched \('https://example.com/cat.png'\); send a data URI "
                       r"or a local file, or start the engine with --allow-remote-images$"):
        load_image("https://example.com/cat.png", LIMITS)


def test_an_allowed_fetch_that_fails_is_one_line():
    # nothing listens on port 9 of the loopback: the connection is refused at once
    with pytest.raises(ImageInputError, match=r"^fetching the image at 'http://127.0.0.1:9/cat.png' failed \(.*\); check the URL"):
        load_image("http://127.0.0.1:9/cat.png", ImageLimits(allow_remote=True, fetch_timeout_s=2))


def test_too_many_images():
    with pytest.raises(ImageInputError, match=r"^the prompt has 3 images but max_images_per_prompt is 2; send fewer images or raise "
                       r"max_images_per_prompt \(--max-images-per-prompt\)$"):
        load_images([gradient_image(2, 2)] * 3, ImageLimits(max_images=2))


def test_too_many_bytes_in_every_form(tmp_path):
    image = gradient_image(16, 16)
    size = len(png_bytes(image))
    small = ImageLimits(max_bytes=size - 1)
    path = tmp_path / "big.png"
    path.write_bytes(png_bytes(image))
    for source in (png_bytes(image), str(path)):
        with pytest.raises(ImageInputError, match=rf"^the image is {size} bytes, over max_image_bytes \({size - 1}\); send a smaller "
                           r"image or raise --max-image-bytes$"):
            load_image(source, small)
    with pytest.raises(ImageInputError, match=r"over max_image_bytes"):
        load_image(data_uri(image), ImageLimits(max_bytes=size // 2))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A PNG declaring ``width`` x ``height`` RGB whose pixel data is empty."""
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + _chunk(b"IDAT", b"")


def test_a_decompression_bomb_is_refused_from_its_header():
    # 10000 x 8000 declared in 45 bytes: refused before any pixel is decoded
    with pytest.raises(ImageInputError, match=r"^the image is 10000 x 8000 = 80000000 pixels, over max_image_pixels \(67108864\); "
                       r"send a smaller image or raise --max-image-pixels$"):
        load_image(_png_header(10000, 8000), LIMITS)
    with pytest.raises(ImageInputError, match=r"^the image declares more pixels than Pillow decodes"):
        load_image(_png_header(20000, 20000), ImageLimits(max_pixels=10**9))
    with pytest.raises(ImageInputError, match=r"is 16 x 16 = 256 pixels, over max_image_pixels \(255\)"):
        load_image(gradient_image(16, 16), ImageLimits(max_pixels=255))


def test_undecodable_data():
    with pytest.raises(ImageInputError, match=r"^the image data is in no format Pillow reads; send a PNG, JPEG, WebP, GIF or BMP image$"):
        load_image(b"definitely not an image", LIMITS)
    with pytest.raises(ImageInputError, match=r"^the image could not be decoded \(.*\); send a PNG"):
        load_image(png_bytes(gradient_image(16, 16))[:60], LIMITS)  # truncated inside its pixel data
    with pytest.raises(ImageInputError, match=r"^image data URI 'data:image/png,abc' is not base64; send data:image/<type>;base64,<data>$"):
        load_image("data:image/png,abc", LIMITS)
    with pytest.raises(ImageInputError, match=r"^the image data URI's payload is not valid base64"):
        load_image("data:image/png;base64,@@@@", LIMITS)
    with pytest.raises(ImageInputError, match=r"^image file '/no/such/cat.png' does not exist; give an existing file"):
        load_image("/no/such/cat.png", LIMITS)
    with pytest.raises(ImageInputError, match=r"^an image is a PIL image, bytes, a data URI or a file path, not int"):
        load_image(3, LIMITS)
    with pytest.raises(ImageInputError, match=r"^image URL 'ftp://host/cat.png' has a scheme this engine does not read"):
        load_image("ftp://host/cat.png", LIMITS)


def test_limits_come_from_the_engine_config_and_its_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--allow-remote-images", "--max-images-per-prompt", "3", "--max-image-bytes", "1000",
                              "--max-image-pixels", "5000", "--image-fetch-timeout-s", "2.5"])
    limits = ImageLimits.from_config(load_config(engine_overrides(args), env={}))
    assert limits == ImageLimits(max_images=3, max_bytes=1000, max_pixels=5000, allow_remote=True, fetch_timeout_s=2.5)
    assert ImageLimits.from_config(load_config({}, env={})) == ImageLimits()
