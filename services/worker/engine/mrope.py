"""M-RoPE positions (Qwen2.5-VL): three positions a token, (time, height, width).

As transformers' `get_rope_index` lays them out: text tokens take one position for all
three, counting on from the one before; an image's rows take its grid's (time, row, column)
positions, each offset by the position where the image starts; text after an image
continues from that start + max(grid height, grid width), i.e. the largest position before
it + 1. Past the prompt's last image every token's three positions are equal: its index
plus the prompt's `delta` (<= 0: an image takes fewer positions than rows).

    positions = prompt_positions(num_prompt_tokens, [(offset, (t, h, w)), ...])  # admission
    step = step_positions(scheduled)   # [T] ints, or [3, T] where a row is an image's

A sequence keeps its prompt's `MropePositions` (None for a prompt without images: its
positions are its indices), so chunked prefill, preemption and recompute read the same.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from PIL import Image

from meshserve.services.worker.engine.images import PromptImage
from meshserve.shared.errors import InvalidRequestError

if TYPE_CHECKING:
    from meshserve.services.worker.engine.step_scheduler import ScheduledSequence

Grid = tuple[int, int, int]  # an image's rows as (time, height, width)


class ImageGrids(Protocol):
    """What positions need of an M-RoPE model: the grid of an image's rows."""

    def image_grid(self, width: int, height: int) -> Grid: ...


class MropePositions:
    """One prompt's positions: a table [3, N] up to the end of its last image, then each
    token's index + `delta` for all three."""

    def __init__(self, table: torch.Tensor, delta: int) -> None:
        self.table = table  # [3, mixed_end] int64
        self.delta = delta

    @property
    def mixed_end(self) -> int:
        """From this token on, the three positions are equal."""
        return self.table.shape[1]

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of tokens start..end-1."""
        cut = min(max(start, self.mixed_end), end)
        after = torch.arange(cut + self.delta, end + self.delta).expand(3, -1)
        return torch.cat((self.table[:, start:cut], after), dim=1)


def prompt_positions(num_tokens: int, images: Sequence[tuple[int, Grid]]
                     ) -> MropePositions | None:
    """The positions of a prompt of `num_tokens` whose images start at `offset` with rows
    `grid` ((offset, grid) in order); None without images."""
    if not images:
        return None
    parts: list[torch.Tensor] = []
    position = cursor = 0  # the next text position; the next token
    for offset, (t, h, w) in images:
        parts.append(torch.arange(position, position + offset - cursor).expand(3, -1))
        position += offset - cursor
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack(grid).reshape(3, -1) + position)  # [3, t * h * w]
        position += max(h, w)  # (transformers: the images' time grid is 1)
        cursor = offset + t * h * w
    assert cursor <= num_tokens, f"images end at {cursor}, past the prompt's {num_tokens}"
    return MropePositions(torch.cat(parts, dim=1), position - cursor)


def image_grids(model: ImageGrids, images: Sequence[PromptImage]) -> list[tuple[int, Grid]]:
    """Each image's (offset, grid), read from its file's header."""
    out = []
    for i, image in enumerate(images):
        try:
            with Image.open(io.BytesIO(image.data)) as opened:
                width, height = opened.size
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"image {i} does not open as an image: {exc}",
                                      param="images") from exc
        t, h, w = model.image_grid(width, height)
        assert t * h * w == image.length, f"image {i}: {t}x{h}x{w} rows, {image.length} tokens"
        out.append((image.offset, (t, h, w)))
    return out


def step_positions(scheduled: Sequence[ScheduledSequence]) -> list[int] | torch.Tensor:
    """A step's positions, in the model runner's row order: [3, T] when a row is an image's
    (so only steps with image rows, which run eagerly, pass [3, T]), else [T], every row's
    three positions being equal (plain RoPE at the shifted position)."""
    flat: list[int] = []
    for s in scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        m = r.mrope
        if m is None:
            flat.extend(range(start, end))
        elif start >= m.mixed_end:
            flat.extend(range(start + m.delta, end + m.delta))
        elif any(image.offset < end and start < image.end for image in r.images):
            return _table(scheduled)
        else:  # text between or before images
            flat.extend(m.rows(start, end)[0].tolist())
    return flat


def _table(scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
    parts = []
    for s in scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        parts.append(torch.arange(start, end).expand(3, -1) if r.mrope is None
                     else r.mrope.rows(start, end))
    return torch.cat(parts, dim=1)  # [3, T]
