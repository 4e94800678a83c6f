"""Memory another process on this host can map: a prefill worker's held KV blocks, by slot.

With `--kv-handoff ipc` a prefill worker holds the blocks it hands off in a `SlotPool`, a
fixed number of block-sized slots in one allocation made at start: device memory on a GPU,
POSIX shared memory on a CPU. A decode worker on the same host maps the whole pool once
(`map_pool`: CUDA IPC, or the shared memory's name) and copies leased slots straight from
it into its own cache, device to device (over NVLink between GPUs of one host), with no
host buffer and no socket carrying the bytes; the TCP listener only says which slots.

The pool's first `HEADER_BYTES` hold a random token, also in its `handle`: a mapping whose
token differs (another host's or another container's memory under the same name, a pool
restarted since) is not used, and the decode worker pulls over TCP instead.

On CUDA the handle is the allocation's IPC handle (`torch.UntypedStorage._share_cuda_`, as
torch.multiprocessing shares tensors), sent as plain values, never pickled. The importer
opens it with its own device current: the memory is mapped into the decode worker's
context with peer access, so a gather on the decode worker's own GPU reads it over the
link, and no CUDA context is made on the prefill worker's GPU.
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import orjson
import torch

from meshserve.shared.errors import ConfigError

HEADER_BYTES = 64  # the token, and room to keep slots aligned


def host_id() -> str:
    """This host's boot id (pools are only mapped on the host that made them)."""
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


class SlotPool:
    """`nbytes` of mappable memory on `device`, cut into block-sized slots by `carve` (a
    worker makes its pool before its KV cache is sized, which then counts it, and learns
    the block size after). Allocation takes the lowest free slots, so a request's blocks
    mostly sit side by side. Thread-safe."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        assert nbytes > HEADER_BYTES, "a pool needs room for slots"
        self.device = device
        self.token = secrets.randbits(63)
        self._shm: shared_memory.SharedMemory | None = None
        if device.type == "cuda":
            self._memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            _check_shm_room(nbytes)
            self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self._memory = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        token = torch.tensor([self.token], dtype=torch.int64).view(torch.uint8)
        self._memory[:8].copy_(token)
        self.slots = 0
        self.slot_bytes = 0
        self.data = self._memory[:0].view(0, 0)
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._handle: bytes | None = None

    def carve(self, slot_bytes: int) -> None:
        """Cut the pool into slots of `slot_bytes` (once, before any allocation)."""
        slots = (self._memory.numel() - HEADER_BYTES) // slot_bytes
        assert slots > 0 and not self.slots, "carve once, into slots that fit"
        self.slots, self.slot_bytes = slots, slot_bytes
        self.data = self._memory[HEADER_BYTES:HEADER_BYTES + slots * slot_bytes].view(
            slots, slot_bytes)
        self._free = list(range(slots))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> torch.Tensor | None:
        """A free slot (a uint8 view of `slot_bytes`), or None when all are taken."""
        with self._lock:
            if not self._free:
                return None
            return self.data[heapq.heappop(self._free)]

    def release(self, slot: torch.Tensor) -> None:
        """Give back a slot `allocate` returned."""
        with self._lock:
            heapq.heappush(self._free, self.index(slot))

    def index(self, slot: torch.Tensor) -> int:
        """The number of a slot `allocate` returned."""
        offset = slot.data_ptr() - self.data.data_ptr()
        assert offset % self.slot_bytes == 0 and 0 <= offset < self.data.numel(), \
            "not a slot of this pool"
        return offset // self.slot_bytes

    def handle(self) -> bytes:
        """What a process on this host needs to map the pool (`map_pool`); made once (each
        CUDA export takes a reference count of its own)."""
        if self._handle is None:
            self._handle = self._export()
        return self._handle

    def _export(self) -> bytes:
        assert self.slots, "carve the pool before handing it out"
        fields: dict[str, Any] = {"host": host_id(), "token": self.token, "slots": self.slots,
                                  "slot_bytes": self.slot_bytes}
        if self._shm is not None:
            fields["shm"] = self._shm.name
        else:
            (device, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = self._memory.untyped_storage()._share_cuda_()
            fields["cuda"] = [device, handle.hex(), size, offset, ref_handle.hex(),
                              ref_offset, event_handle.hex(), bool(event_sync)]
        return orjson.dumps(fields)

    def close(self) -> None:
        """Free the memory (shared memory: unlinked; nothing may use the pool after)."""
        if self._shm is not None:
            del self.data, self._memory
            self._shm.close()
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


def _check_shm_room(nbytes: int) -> None:
    """A shared-memory pool larger than /dev/shm would fail on its first write past the
    room left (SIGBUS): refuse it at start instead, saying what to change."""
    with contextlib.suppress(OSError):
        stats = os.statvfs("/dev/shm")
        free = stats.f_bavail * stats.f_frsize
        if nbytes > free:
            raise ConfigError(
                f"the KV handoff pool needs {nbytes} bytes of shared memory and /dev/shm has "
                f"{free} free: lower --kv-handoff-hold-bytes, or give the worker more shared "
                "memory (docker: --shm-size)", param="kv_handoff_hold_bytes")


@dataclass
class MappedPool:
    """Another process's `SlotPool`, mapped here: `data` is [slots, slot_bytes] uint8."""

    token: int
    data: torch.Tensor
    _keep: object = None  # what must outlive `data` (the shared memory's mapping)

    def close(self) -> None:
        del self.data
        if isinstance(self._keep, mmap.mmap):
            with contextlib.suppress(BufferError):  # a copy still reading: unmapped at exit
                self._keep.close()


def map_pool(handle: bytes, device: torch.device) -> MappedPool | None:
    """Map the pool of `handle` for copies onto `device`; None when it cannot be (another
    host, a device of another kind, memory this process cannot open, a stale token)."""
    try:
        fields = orjson.loads(handle)
        if fields.get("host") != host_id():
            return None
        if "shm" in fields and device.type == "cpu":
            return _map_shm(fields)
        if "cuda" in fields and device.type == "cuda":
            return _map_cuda(fields, device)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError):
        return None
    return None


def _map_shm(fields: dict[str, Any]) -> MappedPool | None:
    """Map another process's segment by its name. Opened as a file of /dev/shm rather than
    as a SharedMemory, whose resource tracker (before Python 3.13) would unlink the segment
    when this process ends; its maker unlinks it."""
    size = HEADER_BYTES + fields["slots"] * fields["slot_bytes"]
    fd = os.open(f"/dev/shm/{fields['shm'].lstrip('/')}", os.O_RDWR)
    try:
        if os.fstat(fd).st_size < size:
            return None
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return _checked(fields, torch.frombuffer(mapping, dtype=torch.uint8, count=size), mapping)


def _map_cuda(fields: dict[str, Any], device: torch.device) -> MappedPool | None:
    (_, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = fields["cuda"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Opened with this worker's own device current: mapped into its context, peer access on.
    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        index, bytes.fromhex(handle), size, offset, bytes.fromhex(ref_handle), ref_offset,
        bytes.fromhex(event_handle), event_sync)
    memory = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    need = HEADER_BYTES + fields["slots"] * fields["slot_bytes"]
    if memory.numel() < need:
        return None
    return _checked(fields, memory[:need], None)


def _checked(fields: dict[str, Any], memory: torch.Tensor, keep: object) -> MappedPool | None:
    token = int(memory[:8].cpu().view(torch.int64)[0])
    if token != fields["token"]:
        if isinstance(keep, mmap.mmap):
            del memory
            keep.close()
        return None
    data = memory[HEADER_BYTES:].view(fields["slots"], fields["slot_bytes"])
    return MappedPool(token, data, keep)
