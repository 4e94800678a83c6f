"""The store's shared region: one anonymous memfd, mapped, with the header of
`shared/kv_region.py`.

An anonymous memfd is used rather than a file in /dev/shm, whose size containers cap
(64 MiB by default in Docker). A same-host client of the same user maps it by opening
`/proc/<store pid>/fd/<fd>`; the token in the header tells it that it mapped this store
(another host's pid may collide with a local one).
"""

from __future__ import annotations

import logging
import mmap
import os

from meshserve.shared.kv_region import HEADER_BYTES, TOKEN_BYTES, write_header

_log = logging.getLogger(__name__)


class SharedArena:
    """A header and `capacity_bytes` of slots in one shared mapping, closed by `close`."""

    def __init__(self, capacity_bytes: int, token: bytes | None = None) -> None:
        assert capacity_bytes > 0, f"capacity_bytes must be positive, got {capacity_bytes}"
        self.size = HEADER_BYTES + capacity_bytes
        self.token = token or os.urandom(TOKEN_BYTES)
        if not hasattr(os, "memfd_create"):
            raise OSError("memfd_create is not available on this platform")
        # Not inherited by children; clients reach it through /proc instead.
        self.fd = os.memfd_create("meshserve-kvstore", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)  # sparse: pages are allocated when written
            self._mmap = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.buffer = memoryview(self._mmap)
        write_header(self.buffer, self.token)

    @property
    def base(self) -> int:
        """Offset of the first slot."""
        return HEADER_BYTES

    @property
    def path(self) -> str:
        """Where a process on this host opens the region."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        """Unmap and close; clients that mapped it keep their mapping until they unmap."""
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:  # a view is still exported; the mapping goes with it
            _log.warning("kvstore region still has views at close; unmapped when released")
        os.close(self.fd)
