"""The worker's vision encoder: image files -> embedding rows, cached by image hash.

`ImageEncoder` is the model runner's `ImageEmbedder` (engine/hooks.py). At admission it
decodes each image and checks that the model makes as many rows of it as the prompt has
placeholder tokens (a bad image fails its request alone). In the step that first computes
an image's placeholders it runs the model folder's image processor and the model's vision
tower and projector (`VisionModel.embed_images`) for every image of the step not cached,
in one batch per image size, and keeps the rows in an LRU under a byte budget: chunked
prefill, preemption and the same image in other requests take them from there.
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from PIL import Image

from meshserve.services.worker.engine.images import ImageSlice, PromptImage
from meshserve.shared.errors import InvalidRequestError

# Decoded images above this many pixels are refused (Pillow's own bomb guard warns at
# about 89 M and raises at twice that).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class VisionModel(Protocol):
    """What a vision-language model gives the encoder (models/llava.py, ...)."""

    def rows_for(self, width: int, height: int) -> int:
        """Embedding rows an image of that size becomes."""
        ...

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's output for N images -> each image's rows [rows, H]."""
        ...


def decode_image(data: bytes, index: int) -> Image.Image:
    """The file's first frame as RGB; InvalidRequestError naming image `index` otherwise."""
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"image {index}: {opened.width}x{opened.height} is more than "
                    f"{MAX_IMAGE_PIXELS} pixels", param="images")
            return opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"image {index} does not decode as an image: {exc}",
                                  param="images") from exc


class ImageEncoder:
    """Image files -> embedding rows for the model runner, with an LRU of rows by hash."""

    def __init__(self, model: VisionModel, processor: Callable[..., Any],
                 device: torch.device, cache_bytes: int) -> None:
        """`processor`: the model folder's image processor (transformers); `cache_bytes`:
        the budget of cached rows (an image larger than it is still encoded, not kept)."""
        self.model = model
        self.processor = processor
        self.device = device
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self.hits = 0
        self.misses = 0

    def check(self, images: Sequence[PromptImage]) -> None:
        for i, image in enumerate(images):
            # The hash keys caches shared by every request: it must be the file's.
            if hashlib.sha256(image.data).digest() != image.digest:
                raise InvalidRequestError(f"image {i}: the hash is not the file's SHA-256",
                                          param="images")
            if image.digest in self._cache:
                rows = self._cache[image.digest].shape[0]
            else:
                decoded = decode_image(image.data, i)
                rows = self.model.rows_for(decoded.width, decoded.height)
            if rows != image.length:
                raise InvalidRequestError(
                    f"image {i} becomes {rows} embedding rows but the prompt has "
                    f"{image.length} placeholder tokens for it", param="images")

    @torch.inference_mode()
    def embed(self, slices: Sequence[ImageSlice]) -> torch.Tensor:
        missing = {s.image.digest: s.image for s in slices if s.image.digest not in self._cache}
        self.hits += len({s.image.digest for s in slices}) - len(missing)
        self.misses += len(missing)
        fresh = self._encode(list(missing.values())) if missing else {}
        parts = []
        for s in slices:
            rows = fresh.get(s.image.digest)
            if rows is None:
                rows = self._cache[s.image.digest]
                self._cache.move_to_end(s.image.digest)
            parts.append(rows[s.first:s.first + s.count])
        for digest, rows in fresh.items():
            self._keep(digest, rows)
        return torch.cat(parts)

    def _encode(self, images: list[PromptImage]) -> dict[bytes, torch.Tensor]:
        """Rows of `images`, batched by decoded size (a batch's pixels share one shape)."""
        decoded = [decode_image(image.data, i) for i, image in enumerate(images)]
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, picture in enumerate(decoded):
            by_size.setdefault(picture.size, []).append(i)
        out: dict[bytes, torch.Tensor] = {}
        for members in by_size.values():
            inputs = self.processor(images=[decoded[i] for i in members], return_tensors="pt")
            tensors = {k: v.to(self.device) for k, v in inputs.items()
                       if isinstance(v, torch.Tensor)}
            for i, rows in zip(members, self.model.embed_images(tensors), strict=True):
                out[images[i].digest] = rows
        return out

    def _keep(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.cache_bytes:
            return
        while self._cached_bytes + size > self.cache_bytes and self._cache:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.numel() * evicted.element_size()
        self._cache[digest] = rows
        self._cached_bytes += size

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


def build_image_encoder(model: Any, source: Any, device: torch.device,
                        cache_bytes: int) -> ImageEncoder:
    """The encoder of a vision-language `model` loaded from `source` (a ModelSource), with
    the image processor of the model folder (transformers' AutoImageProcessor)."""
    from transformers import AutoImageProcessor

    from meshserve.shared.errors import ModelLoadError

    try:
        processor = AutoImageProcessor.from_pretrained(str(source.path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source.path}: no image processor config for this "
                             f"vision-language model ({exc})", param="model") from exc
    return ImageEncoder(model, processor, device, cache_bytes)
