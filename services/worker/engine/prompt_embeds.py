"""Prompt embeddings (--enable-prompt-embeds): the client's rows in place of token embeddings.

A prompt given as embeddings reaches the engine as token ids (one placeholder a row) with one
`PromptImage` over all of them whose `dtype` is set and whose `data` holds the rows
(engine/images.py). From there it is an image: hashed into the prefix cache's block keys by
its digest, its rows placed by the model runner in the steps that compute its positions
(chunked prefill and preemption included). `PromptEmbedsRows` is the runner's
`ImageEmbedder` then: it cuts those rows from the bytes, converted to the model's dtype, and
hands real images to the vision encoder when the model has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from meshserve.services.worker.engine.hooks import ImageEmbedder
from meshserve.services.worker.engine.images import ImageSlice, PromptImage
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.prompt_embeds import DTYPE_SIZES, embeds_digest

_PARAM = "prompt_embeds"


class PromptEmbedsRows:
    """An `ImageEmbedder` for prompt embeddings, and for images through `images`."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 images: ImageEmbedder | None = None) -> None:
        """`hidden_size`, `dtype`: the model's rows; `images`: the vision encoder of a
        vision-language model (None: image files are refused)."""
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.images = images

    def check(self, images: Sequence[PromptImage]) -> None:
        files = [image for image in images if not image.is_embeds]
        if files and self.images is None:
            raise InvalidRequestError("this model does not take images", param="images")
        for image in images:
            if image.is_embeds:
                self._check_rows(image)
        if files and self.images is not None:
            self.images.check(files)

    def _check_rows(self, image: PromptImage) -> None:
        size = DTYPE_SIZES.get(image.dtype)
        if size is None:
            raise InvalidRequestError(f"prompt_embeds must be float32, bfloat16 or float16 "
                                      f"(got {image.dtype})", param=_PARAM)
        # The digest keys blocks shared by every request: it must be these rows'.
        if embeds_digest(image.dtype, image.data) != image.digest:
            raise InvalidRequestError("prompt_embeds: the hash is not the rows'", param=_PARAM)
        row_bytes = self.hidden_size * size
        if len(image.data) != image.length * row_bytes:
            width = len(image.data) / (image.length * size)
            raise InvalidRequestError(
                f"prompt_embeds must have the model's hidden size {self.hidden_size} (got "
                f"{width:g} elements a row over {image.length} rows)", param=_PARAM)

    def prefetch(self, images: Sequence[PromptImage]) -> Future[bool] | None:
        files = [image for image in images if not image.is_embeds]
        if not files or self.images is None:
            return None
        return self.images.prefetch(files)

    def embed(self, slices: Sequence[ImageSlice]) -> torch.Tensor:
        """The rows of `slices` in order: [sum of counts, H], the model's dtype."""
        files = [s for s in slices if not s.image.is_embeds]
        file_rows = None
        if files:
            assert self.images is not None, "image rows scheduled without an encoder"
            file_rows = self.images.embed(files)
        parts, taken = [], 0
        for s in slices:
            if s.image.is_embeds:
                parts.append(self._rows(s))
            else:
                assert file_rows is not None
                parts.append(file_rows[taken:taken + s.count])
                taken += s.count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _rows(self, part: ImageSlice) -> torch.Tensor:
        """Rows [first, first + count) of a prompt's embeddings, on the device."""
        image = part.image
        size = DTYPE_SIZES[image.dtype]
        row_bytes = self.hidden_size * size
        start = part.first * row_bytes
        raw = bytearray(image.data[start:start + part.count * row_bytes])
        rows = torch.frombuffer(raw, dtype=getattr(torch, image.dtype))
        return rows.view(part.count, self.hidden_size).to(self.device, self.dtype)
