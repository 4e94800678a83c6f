"""Decoding one image file with Pillow, to know it is whole and how large it is.

Blocking (Pillow's decoders run in C): the loader calls it in a thread, never on the event
loop. Only PNG, JPEG, WebP and GIF are opened (no other Pillow parser sees client bytes);
the pixel count is checked from the header before anything is decoded (a decompression
bomb is refused unopened), then the whole image is decoded (of a GIF or an animated WebP,
its first frame), so that a truncated or corrupt file is refused here and not in the
worker. The size is the file's own (no EXIF rotation), as the model's processor sees it.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from meshserve.services.gateway.media.policy import ImageRefused

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class DecodedImage:
    """What decoding told of a file, and its SHA-256 (the image's identity in the mesh)."""

    width: int
    height: int
    format: str
    sha256: bytes


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Decode `data` whole; ImageRefused when it is not a supported, sound, small-enough image."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            kind = str(image.format)
            if width * height > max_pixels:
                raise _too_many(width, height, max_pixels)
            image.load()
    except ImageRefused:
        raise
    except Image.DecompressionBombError:  # past Pillow's own limit, before ours was read
        raise ImageRefused("too_many_pixels", f"the image has more than {max_pixels} pixels "
                                              "(--media-max-image-pixels)") from None
    except UnidentifiedImageError:
        claimed = _signature(data)
        if claimed is not None:  # its header cannot even be read
            raise ImageRefused("undecodable", f"the {claimed} file is truncated or corrupt") \
                from None
        raise ImageRefused("not_image", "it is not a PNG, JPEG, WebP or GIF image") from None
    except Exception as exc:  # noqa: BLE001 (any decoder failure on client bytes is a 400)
        raise ImageRefused("undecodable", f"the image cannot be decoded "
                                          f"({type(exc).__name__}: {str(exc)[:160]})") from None
    return DecodedImage(width, height, kind, hashlib.sha256(data).digest())


def _signature(data: bytes) -> str | None:
    """The supported format whose magic bytes `data` starts with."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def _too_many(width: int, height: int, max_pixels: int) -> ImageRefused:
    return ImageRefused("too_many_pixels", f"the image is {width}x{height}, "
                                           f"{width * height} pixels, more than the "
                                           f"{max_pixels} allowed (--media-max-image-pixels)")
