"""`data:` URLs of images (RFC 2397), as vLLM takes them: `data:image/<subtype>;base64,<data>`.

The media type must be an image type and the payload base64 (vLLM supports no other
encoding); the declared subtype need not match the file (the decoder reads the bytes).
The size cap is checked on the payload's length before anything is decoded.
"""

from __future__ import annotations

import base64
import binascii

from meshserve.services.gateway.media.policy import ImageRefused


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def parse_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes a data URL carries; ImageRefused when it is not an image's or too large."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageRefused("bad_data_url", "the data URL has no ',' before its data")
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if not media_type.startswith("image/"):
        raise ImageRefused("bad_data_url", f"the data URL's media type must be image/..., got "
                                           f"{media_type or 'none'!r:.60}")
    if "base64" not in params:
        raise ImageRefused("bad_data_url", "only base64 data URLs are supported "
                                           "(data:image/png;base64,...)")
    # Every 4 base64 characters carry 3 bytes; less the padding.
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if size > max_bytes:
        raise ImageRefused("too_large", f"the image is {size} bytes, more than the "
                                        f"{max_bytes} allowed (--media-max-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("bad_data_url", "the data URL's payload is not valid base64") \
            from None
    if not data:
        raise ImageRefused("bad_data_url", "the data URL carries no data")
    return data
