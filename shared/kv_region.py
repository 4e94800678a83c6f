"""Layout of the kvstore's shared region, known to the store that writes it and to the
workers that map it.

    [0, 8)               magic, b"MSKVREG1" (the layout's version is its last byte)
    [8, 24)              token: 16 random bytes, also returned by the store's Attach
    [24, HEADER_BYTES)   zero
    [HEADER_BYTES, end)  the arena: fixed-size block slots at offsets the store gives out

The header fills a page so that the arena starts page-aligned.
"""

from __future__ import annotations

MAGIC = b"MSKVREG1"
TOKEN_BYTES = 16
HEADER_BYTES = 4096
_TOKEN_AT = len(MAGIC)


def write_header(region: memoryview, token: bytes) -> None:
    """Write the magic and `token` at the start of `region`."""
    assert len(token) == TOKEN_BYTES, f"token has {len(token)} bytes, expected {TOKEN_BYTES}"
    region[:_TOKEN_AT] = MAGIC
    region[_TOKEN_AT:_TOKEN_AT + TOKEN_BYTES] = token


def header_token(region: memoryview) -> bytes | None:
    """The token in `region`'s header; None when it does not start with the magic."""
    if len(region) < HEADER_BYTES or bytes(region[:_TOKEN_AT]) != MAGIC:
        return None
    return bytes(region[_TOKEN_AT:_TOKEN_AT + TOKEN_BYTES])
