"""Images in the block hashes (shared/block_hash.py) and in the step rows
(services/worker/engine/images.py): exact blocks and rows."""

from __future__ import annotations

import hashlib

import pytest

from meshserve.services.worker.engine.images import PromptImage, check_images, slices_in
from meshserve.shared.block_hash import ImageSpan, hash_blocks
from meshserve.shared.errors import InvalidRequestError

TOKENS = list(range(100, 140))  # 40 tokens: 5 full blocks of 8
CAT = hashlib.sha256(b"cat").digest()
DOG = hashlib.sha256(b"dog").digest()


def test_without_images_the_hashes_are_the_text_hashes() -> None:
    assert hash_blocks(TOKENS, 8, images=()) == hash_blocks(TOKENS, 8)


def test_blocks_before_the_image_are_shared_and_every_later_one_differs() -> None:
    cat = hash_blocks(TOKENS, 8, images=[ImageSpan(12, 10, CAT)])  # tokens 12..21: blocks 1, 2
    dog = hash_blocks(TOKENS, 8, images=[ImageSpan(12, 10, DOG)])
    text = hash_blocks(TOKENS, 8)
    assert cat[0] == dog[0] == text[0]
    assert all(c != d and c != t for c, d, t in zip(cat[1:], dog[1:], text[1:], strict=True))
    # The same image elsewhere is another prompt: its placeholders start at another token.
    moved = hash_blocks(TOKENS, 8, images=[ImageSpan(13, 10, CAT)])
    assert moved[0] == cat[0] and moved[1] != cat[1]


def test_incremental_hashing_over_an_image_equals_hashing_at_once() -> None:
    spans = [ImageSpan(5, 6, CAT), ImageSpan(20, 12, DOG)]
    whole = hash_blocks(TOKENS, 8, images=spans)
    head = hash_blocks(TOKENS[:16], 8, images=spans)
    tail = hash_blocks(TOKENS, 8, parent=head[-1], start_block=2, images=spans)
    assert head + tail == whole


def _image(offset: int, length: int, data: bytes = b"cat") -> PromptImage:
    return PromptImage(data, hashlib.sha256(data).digest(), offset, length)


def test_slices_are_the_rows_a_query_covers() -> None:
    images = [_image(4, 6), _image(12, 3, b"dog")]
    parts = slices_in(images, 6, 13)  # rows 6..12: image 0's rows 2..5, image 1's row 0
    assert [(s.image.offset, s.first, s.count) for s in parts] == [(4, 2, 4), (12, 0, 1)]
    assert slices_in(images, 0, 4) == [] and slices_in(images, 15, 30) == []


@pytest.mark.parametrize(("images", "message"), [
    ([_image(0, 4), _image(3, 2)], "after the image before it"),
    ([_image(8, 4)], "inside the prompt"),
    ([_image(2, 0)], "non-empty"),
    ([PromptImage(b"x", b"short", 0, 2)], "32-byte"),
])
def test_images_must_lie_apart_in_order_inside_the_prompt(images, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        check_images(images, num_prompt_tokens=10, takes_images=True)


def test_a_text_model_takes_no_images() -> None:
    check_images([], num_prompt_tokens=10, takes_images=False)
    with pytest.raises(InvalidRequestError, match="does not take images"):
        check_images([_image(0, 2)], num_prompt_tokens=10, takes_images=False)
