"""The worker's vision encoder: image files -> embedding rows, cached by image hash.

`ImageEncoder` is the model runner's `ImageEmbedder` (engine/hooks.py). At admission it
checks each image: the hash is the file's, the file decodes, and the model makes as many
rows of it as the prompt has placeholder tokens (a bad image fails its request alone). In
the step that first computes an image's placeholders it asks its `RowsSource` for the rows
of every image of the step not cached: the worker's own vision half
(shared/image_encoding.py's `RowsEncoder`) or an encoder service (remote.py). Rows stay in an
LRU under a byte budget: chunked prefill, preemption and the same image in other requests
take them from there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from meshserve.services.worker.engine.images import ImageSlice, PromptImage
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.image_encoding import (
    RowsCache,
    RowsEncoder,
    VisionModel,
    decode_image,
    load_image_processor,
)


class RowsSource(Protocol):
    """Where rows come from: (digest, file) pairs -> {digest: rows [R, H]} on the device."""

    def encode(self, files: Sequence[tuple[bytes, bytes]]) -> dict[bytes, torch.Tensor]: ...


class ImageEncoder:
    """Image files -> embedding rows for the model runner, with an LRU of rows by hash."""

    def __init__(self, model: VisionModel, source: RowsSource, cache_bytes: int) -> None:
        """`model`: says how many rows an image becomes; `source`: makes them;
        `cache_bytes`: the budget of cached rows."""
        self.model = model
        self.source = source
        self.cache = RowsCache(cache_bytes)
        self.hits = 0
        self.misses = 0

    def check(self, images: Sequence[PromptImage]) -> None:
        for i, image in enumerate(images):
            # The hash keys caches shared by every request: it must be the file's.
            if hashlib.sha256(image.data).digest() != image.digest:
                raise InvalidRequestError(f"image {i}: the hash is not the file's SHA-256",
                                          param="images")
            cached = self.cache.get(image.digest)
            if cached is not None:
                rows = cached.shape[0]
            else:
                decoded = decode_image(image.data, f"image {i}")
                rows = self.model.rows_for(decoded.width, decoded.height)
            if rows != image.length:
                raise InvalidRequestError(
                    f"image {i} becomes {rows} embedding rows but the prompt has "
                    f"{image.length} placeholder tokens for it", param="images")

    def embed(self, slices: Sequence[ImageSlice]) -> torch.Tensor:
        missing = {s.image.digest: s.image.data for s in slices
                   if s.image.digest not in self.cache}
        self.hits += len({s.image.digest for s in slices}) - len(missing)
        self.misses += len(missing)
        fresh = self.source.encode(list(missing.items())) if missing else {}
        parts = []
        for s in slices:
            rows = fresh.get(s.image.digest)
            if rows is None:
                rows = self.cache.get(s.image.digest)
                assert rows is not None, "an image's rows left the cache within one step"
            parts.append(rows[s.first:s.first + s.count])
        for digest, rows in fresh.items():
            self.cache.put(digest, rows)
        return torch.cat(parts)


def build_image_encoder(model: VisionModel, folder: Path, device: torch.device,
                        cache_bytes: int) -> ImageEncoder:
    """The encoder of a vision-language `model` loaded from `folder`, encoding in process
    with the folder's image processor."""
    return ImageEncoder(model, RowsEncoder(model, load_image_processor(folder), device),
                        cache_bytes)
