"""Embedding rows handed over through files in shared memory (one host, no copy in gRPC).

The service writes each answer's rows into a fresh file under its shared-memory folder and
sends only the path; the caller reads the file and deletes it (`read_rows_file`). Files a
caller never read (it went away) are deleted by `RowsFiles.expire` after their time to
live, so the folder cannot fill up.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from pathlib import Path

import torch

_PREFIX = "meshserve-rows-"


def rows_bytes(rows: torch.Tensor) -> bytes:
    """A [R, H] tensor's elements, row-major, as bytes (any dtype, bfloat16 included)."""
    return rows.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


class RowsFiles:
    """The files this service wrote, oldest first, for expiry."""

    def __init__(self, folder: Path, ttl_s: float) -> None:
        self.folder = folder
        self.ttl_s = ttl_s
        self._written: deque[tuple[float, Path]] = deque()

    def write(self, rows: torch.Tensor) -> str:
        """Write `rows` to a new file; its path."""
        path = self.folder / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        with open(path, "wb") as out:
            out.write(rows_bytes(rows))
        self._written.append((time.monotonic(), path))
        return str(path)

    def expire(self, now: float | None = None) -> int:
        """Delete the files older than the time to live that are still there; how many."""
        now = time.monotonic() if now is None else now
        deleted = 0
        while self._written and now - self._written[0][0] >= self.ttl_s:
            _, path = self._written.popleft()
            try:
                path.unlink()
                deleted += 1
            except FileNotFoundError:  # read and deleted by its caller: the usual case
                pass
        return deleted

    def delete_all(self) -> None:
        """At shutdown: every file not read yet."""
        self.expire(now=float("inf"))


def read_rows_file(path: str, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Read a rows file into a [rows, hidden] tensor and delete it."""
    try:
        data = torch.from_file(path, shared=False, size=rows * hidden, dtype=dtype)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return data.view(rows, hidden)
