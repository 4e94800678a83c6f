"""Images of a prompt as the engine core sees them: where their embedding rows go.

A vision-language prompt holds, for each image, a run of placeholder tokens; the model's
input there is the image's embeddings (from the vision encoder, `ImageEmbedder`) instead
of the placeholder token's embedding. The engine keeps the images with the sequence, hashes
them into the prefix cache's block keys, and the model runner fills each step's rows that
fall on a placeholder run. A prompt given as embeddings (`prompt_embeds`) is one such run
over the whole prompt whose rows the client sent (`PromptImage.dtype` set; the rows come
from engine/prompt_embeds.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.shared.block_hash import ImageSpan
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.prompt_embeds import DISABLED_MESSAGE


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its encoded file and the placeholder tokens it replaces; or,
    with `dtype`, a prompt's own embedding rows."""

    data: bytes  # the file as the client sent it (PNG, JPEG, WebP, ...), or the rows
    digest: bytes  # its SHA-256: the key of the embedding cache and of block hashes
    offset: int  # first placeholder position in the prompt
    length: int  # placeholder tokens = the image's embedding rows
    # Prompt embeddings: `data` is [length, hidden] row-major elements of this dtype
    # (float32, bfloat16, float16) and `digest` shared/prompt_embeds.py's embeds_digest.
    dtype: str = ""

    @property
    def is_embeds(self) -> bool:
        return bool(self.dtype)

    @property
    def span(self) -> ImageSpan:
        return ImageSpan(self.offset, self.length, self.digest)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImageSlice:
    """The rows of one image that one step's query covers."""

    image: PromptImage
    first: int  # first embedding row of the image taken
    count: int  # rows taken


def slices_in(images: Sequence[PromptImage], start: int, end: int) -> list[ImageSlice]:
    """The parts of `images` (sorted, apart) that positions [start, end) cover."""
    out = []
    for image in images:
        if image.offset >= end:
            break
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo < hi:
            out.append(ImageSlice(image, lo - image.offset, hi - lo))
    return out


def image_lookahead(num_rows: int, image_rows: Sequence[int],
                    image_slices: Sequence[ImageSlice]) -> list[int]:
    """For a model whose image rows attend to their whole image: per row of a step, how many
    keys after its own it reads (`AttentionMetadata.lookahead`): the rows of its image after
    it, for a row on an image (`image_rows`, taken in `image_slices`' order); 0 elsewhere
    (prompt embeddings' rows among them: they stay causal)."""
    ahead = [0] * num_rows
    rows = iter(image_rows)
    for part in image_slices:
        for first in range(part.first, part.first + part.count):
            row = next(rows)
            if not part.image.is_embeds:
                ahead[row] = part.image.length - 1 - first
    return ahead


def check_images(images: Sequence[PromptImage], num_prompt_tokens: int,
                 takes_images: bool) -> None:
    """Refuse images a model cannot take, or that do not lie apart, in order, inside the
    prompt (InvalidRequestError). `takes_images`: the runner has an `ImageEmbedder` (which
    refuses what it cannot make: engine/prompt_embeds.py)."""
    if not images:
        return
    if not takes_images:
        if any(image.is_embeds for image in images):
            raise InvalidRequestError(DISABLED_MESSAGE, param="prompt_embeds")
        raise InvalidRequestError("this model does not take images", param="images")
    end = 0
    for i, image in enumerate(images):
        if len(image.digest) != 32:
            raise InvalidRequestError(f"image {i}: the hash must be a 32-byte SHA-256",
                                      param="images")
        if image.length <= 0 or image.offset < end or image.end > num_prompt_tokens:
            raise InvalidRequestError(
                f"image {i}: placeholder tokens {image.offset}..{image.end} must be a "
                f"non-empty run inside the prompt's {num_prompt_tokens} tokens, after the "
                f"image before it", param="images")
        end = image.end
