"""Image files -> embedding rows, as the worker and the encoder service both run it.

    encoder = RowsEncoder(part, load_image_processor(folder), device)
    rows = encoder.encode([(digest, file_bytes), ...])   # {digest: [rows, H]}

`decode_image` opens a file as RGB (a bad file is an InvalidRequestError naming it);
`RowsEncoder` runs the model folder's image processor (transformers) and a vision half
(shared/vision_models.py) over a batch of images, one forward per decoded size; `RowsCache`
keeps rows by image hash, least recently used first out, under a byte budget.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image

from meshserve.shared.errors import InvalidRequestError, ModelLoadError

# Decoded images above this many pixels are refused (Pillow's own bomb guard warns at
# about 89 M and raises at twice that).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class VisionModel(Protocol):
    """What the encoder needs of a model's vision half (shared/vision_models.py)."""

    def rows_for(self, width: int, height: int) -> int: ...

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]: ...


def decode_image(data: bytes, what: str) -> Image.Image:
    """The file's first frame as RGB; InvalidRequestError naming `what` otherwise."""
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"{what}: {opened.width}x{opened.height} is more than "
                    f"{MAX_IMAGE_PIXELS} pixels", param="images")
            return opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"{what} does not decode as an image: {exc}",
                                  param="images") from exc


def load_image_processor(folder: Path) -> Callable[..., Any]:
    """The model folder's image processor (transformers' AutoImageProcessor)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(folder))  # type: ignore[no-any-return]
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}: no image processor config for this "
                             f"vision-language model ({exc})", param="model") from exc


class RowsEncoder:
    """Runs the image processor and a vision half over batches of image files."""

    def __init__(self, model: VisionModel, processor: Callable[..., Any],
                 device: torch.device) -> None:
        self.model = model
        self.processor = processor
        self.device = device

    @torch.inference_mode()
    def encode(self, files: Sequence[tuple[bytes, bytes]]) -> dict[bytes, torch.Tensor]:
        """(digest, file) pairs -> {digest: rows [R, H]}; a batch per decoded size, whose
        pixels share one shape."""
        decoded = [decode_image(data, f"image {i}") for i, (_, data) in enumerate(files)]
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, picture in enumerate(decoded):
            by_size.setdefault(picture.size, []).append(i)
        out: dict[bytes, torch.Tensor] = {}
        for members in by_size.values():
            inputs = self.processor(images=[decoded[i] for i in members], return_tensors="pt")
            tensors = {k: v.to(self.device) for k, v in inputs.items()
                       if isinstance(v, torch.Tensor)}
            for i, rows in zip(members, self.model.embed_images(tensors), strict=True):
                out[files[i][0]] = rows
        return out


class RowsCache:
    """Embedding rows by image hash: an LRU under a byte budget (rows larger than the
    whole budget are not kept)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._rows

    def get(self, digest: bytes) -> torch.Tensor | None:
        rows = self._rows.get(digest)
        if rows is not None:
            self._rows.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.budget_bytes or digest in self._rows:
            return
        while self.cached_bytes + size > self.budget_bytes and self._rows:
            _, evicted = self._rows.popitem(last=False)
            self.cached_bytes -= evicted.numel() * evicted.element_size()
        self._rows[digest] = rows
        self.cached_bytes += size
