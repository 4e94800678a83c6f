"""The one block-hash function of meshserve.

A KV block is identified by the hash of its full token contents chained to the
hash of the block before it, plus extra keys (LoRA id, cache salt) that make
otherwise identical tokens produce different KV. The hash is SHA-256 over a
canonical byte encoding, so it is the same in every process and on every
machine: workers, the scheduler, the kvstore and Redis keys all agree on it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import orjson

BlockHash = bytes
"""A 32-byte SHA-256 digest."""

# Parent of the first block of every sequence; versioned so that a change of
# encoding can never match hashes written by an older release.
ROOT_HASH: BlockHash = hashlib.sha256(b"meshserve/block-hash/v1").digest()


def extra_keys_for(lora_id: int | None = None, cache_salt: str | None = None) -> tuple[object, ...]:
    """The extra keys of a request, in canonical order (empty when there are none)."""
    keys: list[object] = []
    if lora_id is not None:
        keys.append(("lora", int(lora_id)))
    if cache_salt:
        keys.append(("salt", cache_salt))
    return tuple(keys)


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    """Hash one full block of tokens chained to its parent block's hash."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    if extra_keys:
        h.update(orjson.dumps(list(extra_keys)))
    return h.digest()


class ImageSpan(NamedTuple):
    """An image's placeholder tokens in a prompt and the image's identity."""

    offset: int  # first placeholder position
    length: int  # placeholder tokens
    digest: bytes  # SHA-256 of the image file


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] = (),
    parent: BlockHash | None = None,
    start_block: int = 0,
    images: Sequence[ImageSpan] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` from block `start_block` on.

    `parent` is the hash of block `start_block - 1` (None for the first block),
    so a caller that already holds the first hashes extends them incrementally.
    A block that holds placeholder tokens of one of `images` adds that image's digest
    (and where its tokens start) to its extra keys: the same placeholders over another
    image are other KV, and the chain carries the difference to every later block, while
    the blocks before the first image stay shared with any prompt of the same text.
    """
    assert block_size > 0, f"block_size must be positive, got {block_size}"
    hashes: list[BlockHash] = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        keys = extra_keys
        end = start + block_size
        overlapping = tuple(("image", span.digest.hex(), span.offset) for span in images
                            if span.offset < end and start < span.offset + span.length)
        if overlapping:
            keys = extra_keys + overlapping
        parent = hash_block(parent, token_ids[start:end], keys)
        hashes.append(parent)
    return hashes
