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
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from meshserve.services.worker.engine.images import ImageSlice, PromptImage
from meshserve.services.worker.vision.remote import RemoteRows
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.image_encoding import (
    RowsCache,
    RowsEncoder,
    VisionModel,
    decode_image,
    load_image_processor,
)

# Hashes of decoded files remembered (with their row counts) for admission checks.
_DECODED_KEPT = 4096


class RowsSource(Protocol):
    """Where rows come from: (digest, file) pairs -> {digest: rows [R, H]} on the device."""

    def encode(self, files: Sequence[tuple[bytes, bytes]]) -> dict[bytes, torch.Tensor]: ...


class ImageEncoder:
    """Image files -> embedding rows for the model runner, with an LRU of rows by hash."""

    def __init__(self, model: VisionModel, local: RowsSource | None, device: torch.device,
                 cache_bytes: int, remote: RemoteRows | None = None) -> None:
        """`model`: says how many rows an image becomes; `local`: makes them in this
        process (None: only `remote` does); `remote`: encoder services, asked ahead at
        admission; `cache_bytes`: the budget of cached rows."""
        assert local is not None or remote is not None, "rows must come from somewhere"
        self.model = model
        self.local = local
        self.remote = remote
        self.device = device
        self.cache = RowsCache(cache_bytes)
        # Counters for /metrics (serving/image_metrics.py): images a step asked for that
        # were cached, that were not, rows that came from services, and seconds the engine
        # thread spent making rows itself.
        self.hits = 0
        self.misses = 0
        self.from_services = 0
        self.encoded_here = 0
        self.encode_seconds = 0.0
        # Files that decoded whole, by hash -> their rows: decoding (milliseconds an image)
        # happens on these threads while the request waits, not on the engine thread.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="image-check")
        self._decoded: OrderedDict[bytes, int] = OrderedDict()

    def prefetch(self, images: Sequence[PromptImage]) -> Future[bool] | None:
        """Decode `images` and count their rows, and with encoder services have them made,
        off the engine thread; the request joins the engine when the future is done (it
        raises InvalidRequestError for a bad image). None: nothing to do."""
        todo = [image for image in images if image.digest not in self.cache]
        if not todo or (self.remote is None
                        and all(image.digest in self._decoded for image in todo)):
            return None
        return self._pool.submit(self._prepare, todo)

    def check(self, images: Sequence[PromptImage]) -> None:
        for i, image in enumerate(images):
            # The hash keys caches shared by every request: it must be the file's.
            if hashlib.sha256(image.data).digest() != image.digest:
                raise InvalidRequestError(f"image {i}: the hash is not the file's SHA-256",
                                          param="images")
            cached = self.cache.get(image.digest)
            rows = (cached.shape[0] if cached is not None
                    else self._decoded.get(image.digest) or self._inspect(image, i))
            if rows != image.length:
                raise InvalidRequestError(
                    f"image {i} becomes {rows} embedding rows but the prompt has "
                    f"{image.length} placeholder tokens for it", param="images")

    def _prepare(self, images: list[PromptImage]) -> bool:
        """(On a check thread.) Every image decoded and counted; then, with services, its
        rows fetched: False when every service failed and the worker encodes them."""
        for i, image in enumerate(images):
            if image.digest not in self._decoded:
                self._inspect(image, i)
        if self.remote is None:
            return True
        return self.remote.fetch(images, must_succeed=self.local is None)

    def _inspect(self, image: PromptImage, index: int) -> int:
        """Decode the whole file (a bad one is refused here, never mid-step) and remember
        its rows."""
        if hashlib.sha256(image.data).digest() != image.digest:
            raise InvalidRequestError(f"image {index}: the hash is not the file's SHA-256",
                                      param="images")
        decoded = decode_image(image.data, f"image {index}")
        rows = self.model.rows_for(decoded.width, decoded.height)
        self._decoded[image.digest] = rows
        while len(self._decoded) > _DECODED_KEPT:
            self._decoded.popitem(last=False)
        return rows

    def embed(self, slices: Sequence[ImageSlice]) -> torch.Tensor:
        missing = {s.image.digest: s.image.data for s in slices
                   if s.image.digest not in self.cache}
        self.hits += len({s.image.digest for s in slices}) - len(missing)
        self.misses += len(missing)
        fresh = self._rows(missing) if missing else {}
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

    def _rows(self, missing: dict[bytes, bytes]) -> dict[bytes, torch.Tensor]:
        """Rows of images not cached: those fetched ahead, then the rest encoded now."""
        fresh: dict[bytes, torch.Tensor] = {}
        if self.remote is not None:
            for digest in missing:
                rows = self.remote.take(digest)
                if rows is not None:
                    fresh[digest] = rows.to(self.device, non_blocking=True)
        self.from_services += len(fresh)
        rest = [(digest, data) for digest, data in missing.items() if digest not in fresh]
        if rest:  # (evicted since admission, or no services)
            started = time.perf_counter()
            source: RowsSource = self.local if self.local is not None else self.remote  # type: ignore[assignment]
            fresh.update({digest: rows.to(self.device)
                          for digest, rows in source.encode(rest).items()})
            self.encode_seconds += time.perf_counter() - started
            self.encoded_here += len(rest)
        return fresh


def build_image_encoder(model: VisionModel, folder: Path, device: torch.device,
                        cache_bytes: int, placement: str = "worker",
                        remote: RemoteRows | None = None) -> ImageEncoder:
    """The encoder of a vision-language `model` loaded from `folder`: in process with the
    folder's image processor, through `remote` encoder services, or both ("auto": the
    services first, the worker itself when they fail)."""
    local = None if placement == "encoder" else RowsEncoder(
        model, load_image_processor(folder), device)
    return ImageEncoder(model, local, device, cache_bytes,
                        None if placement == "worker" else remote)
