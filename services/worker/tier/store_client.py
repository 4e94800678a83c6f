"""Blocking client of the kvstore, for the worker's KV transfer thread.

    client = KVStoreClient("127.0.0.1:50054", namespace)
    client.connect()
    reservation = client.reserve(hashes, parents, "bfloat16", (layers, 2, 16, heads, dim))
    for view in reservation.views:          # None: the store has it, or has no room
        ...copy a block's bytes into view...
    client.commit(reservation)
    lease = client.acquire(hashes)          # the leading blocks held
    ...copy from lease.views...
    client.release(lease)

On the store's host the client maps the store's shared region and blocks move by one
memory copy each way: `reserve` hands out views of reserved slots, `acquire` views of
held blocks, pinned until `release`. Anywhere else (or with `shm=False`, or where the
region cannot be mapped) the same calls move bytes over gRPC: `reserve` hands out local
buffers that `commit` sends with Put, and `acquire` reads with Get.

Not thread-safe: one thread uses a client. Every call has a deadline, and every failure
to reach the store, or a store that restarted since `connect` (its region is gone), is
KVStoreUnavailable; `connect` again maps the new region.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from meshserve.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.kv_dtype import KV_DTYPE_BYTES, block_nbytes
from meshserve.shared.kv_region import header_token

_log = logging.getLogger(__name__)

# Blocks per Put message on the byte path stay under this many bytes (as the store's Get).
PUT_MESSAGE_BYTES = 4 * 2**20

R = TypeVar("R")


class KVStoreUnavailable(Exception):
    """The store is down, unreachable, or restarted since `connect` (its region is gone)."""


@dataclass
class Reservation:
    """Where to write blocks; commit or abandon it."""

    hashes: list[bytes]
    views: list[memoryview | None]  # per hash: writable buffer of the block's bytes, None =
    # skip (the store already holds it, or refused it)
    reservation_id: int = 0  # the store's reservation of region slots; 0: none
    parents: list[bytes] = field(default_factory=list)
    dtype: str = ""
    shape: tuple[int, ...] = ()
    by_put: list[bool] = field(default_factory=list)  # per hash: a local buffer sent by Put
    offsets: list[int | None] = field(default_factory=list)  # per hash: where its view
    # starts in `KVStoreClient.region` (None: not a region slot)


@dataclass
class Lease:
    """Blocks readable until `release`."""

    hashes: list[bytes]  # the leading hashes found (a prefix of those asked)
    views: list[memoryview]  # read-only buffers of each block's bytes, valid until release
    lease_id: int = 0  # the store's lease on region blocks; 0: none (bytes received)
    offsets: list[int | None] = field(default_factory=list)  # per hash: where its view
    # starts in `KVStoreClient.region` (None: bytes received)


class KVStoreClient:
    """One worker's connection to one kvstore, for one KV namespace."""

    def __init__(self, address: str, namespace: str, *, shm: bool = True,
                 timeout_s: float = 5.0) -> None:
        assert namespace, "namespace must not be empty"
        assert timeout_s > 0, f"timeout_s must be positive, got {timeout_s}"
        self.address = address
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._want_shm = shm
        self._channel: grpc.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self._token = b""
        self._mmap: mmap.mmap | None = None
        self._region: memoryview | None = None
        self.store_id = ""
        self.expired_leases = 0  # leases the store had ended before release (see release)

    # -- connection --------------------------------------------------------------------

    def connect(self) -> None:
        """Attach to the store (again after a restart); maps its region when on its host."""
        self.close()
        self._channel = grpc.insecure_channel(self.address,
                                              options=GrpcClient().channel_options())
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        try:
            attach = self._call(self._stub.Attach, kvstore_pb2.AttachRequest())
        except KVStoreUnavailable:
            self.close()
            raise
        self._token = attach.region_token
        self.store_id = attach.store_id
        if self._want_shm and attach.shm_path:
            self._map(attach)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Whether the channel (re)connects to the store within `timeout_s` (default: the
        client's timeout). It does not attach again: a store that restarted meanwhile
        refuses the next call (KVStoreUnavailable) until `connect`."""
        if self._channel is None:
            return False
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s or self.timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True

    @property
    def shared_memory(self) -> bool:
        """Whether blocks move through the mapped region (else over gRPC)."""
        return self._region is not None

    @property
    def region(self) -> memoryview | None:
        """The whole mapped region (the worker pins it for fast host-to-device copies)."""
        return self._region

    def close(self) -> None:
        """Close the channel and unmap the region (views still exported keep it mapped)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None
        region, mapped = self._region, self._mmap
        self._region = self._mmap = None
        if region is not None and mapped is not None:
            try:
                region.release()
                mapped.close()
            except BufferError:  # a view (or a tensor over it) still uses it: unmapped with it
                _log.warning("kvstore region still in use at close; unmapped when released")

    def _map(self, attach: kvstore_pb2.AttachResponse) -> None:
        """Map the region when it is this store's; otherwise stay on the byte path."""
        path, size = attach.shm_path, attach.region_bytes
        try:
            # The path names the store's pid: on another host it may be any file, so only
            # a regular file of the region's size is even opened.
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise OSError(f"{path} is not a {size}-byte region")
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            _log.info("kvstore %s: region not mappable here (%s); using the byte path",
                      self.address, exc)
            return
        region = memoryview(mapped)
        if header_token(region) != self._token:
            region.release()
            mapped.close()
            _log.info("kvstore %s: %s is another region; using the byte path", self.address,
                      path)
            return
        self._mmap, self._region = mapped, region

    # -- writing -----------------------------------------------------------------------

    def reserve(self, hashes: Sequence[bytes], parents: Sequence[bytes], dtype: str,
                shape: tuple[int, ...]) -> Reservation:
        """Buffers to write blocks of `dtype` and C-contiguous `shape` into, one per hash
        (head of the chain first; None where the store holds the block or has no room).
        `parents`: the hash before each block (b"" for a first block), or empty."""
        parents = list(parents) or [b""] * len(hashes)
        _check_block(hashes, parents, dtype, shape)
        nbytes = block_nbytes(dtype, shape)
        reservation = Reservation(list(hashes), [], 0, parents, dtype, tuple(shape))
        if not hashes:
            return reservation
        if self._region is None:
            request = kvstore_pb2.ContainsRequest(kv_namespace=self.namespace,
                                                  block_hashes=hashes)
            held = self._call(self._connected().Contains, request).present
            reservation.by_put = [not present for present in held]
            reservation.offsets = [None] * len(held)
            reservation.views = [memoryview(bytearray(nbytes)) if put else None
                                 for put in reservation.by_put]
            return reservation
        response = self._call(self._connected().Reserve, kvstore_pb2.ReserveRequest(
            kv_namespace=self.namespace, region_token=self._token, block_hashes=hashes,
            parent_hashes=parents, dtype=_dtype_enum(dtype), shape=shape))
        reservation.reservation_id = response.reservation_id
        for status, offset in zip(response.status, response.offsets, strict=True):
            by_put = status == kvstore_pb2.RESERVE_STATUS_BYTES_ONLY
            reservation.by_put.append(by_put)
            if status == kvstore_pb2.RESERVE_STATUS_RESERVED:
                reservation.views.append(self._region[offset:offset + nbytes])
                reservation.offsets.append(offset)
            else:
                reservation.views.append(memoryview(bytearray(nbytes)) if by_put else None)
                reservation.offsets.append(None)
        return reservation

    def commit(self, reservation: Reservation) -> int:
        """Store the written blocks; returns how many the store newly holds."""
        stored = 0
        if reservation.reservation_id:
            response = self._call(self._connected().Commit, kvstore_pb2.CommitRequest(
                region_token=self._token, reservation_id=reservation.reservation_id))
            if response.expired:
                _log.warning("kvstore reservation %d expired before commit; not stored",
                             reservation.reservation_id)
            stored += response.num_stored
        if any(reservation.by_put):
            stored += self._put(reservation).num_stored
        _release_views(reservation.views)
        return stored

    def abandon(self, reservation: Reservation) -> None:
        """Store none of the reservation's blocks."""
        if reservation.reservation_id:
            self._call(self._connected().Abandon, kvstore_pb2.AbandonRequest(
                region_token=self._token, reservation_id=reservation.reservation_id))
        _release_views(reservation.views)

    def _put(self, reservation: Reservation) -> kvstore_pb2.PutResponse:
        dtype = _dtype_enum(reservation.dtype)
        blocks = [kvstore_pb2.KVBlock(block_hash=h, parent_hash=parent, data=bytes(view),
                                      dtype=dtype, shape=reservation.shape)
                  for h, parent, view, by_put in zip(reservation.hashes, reservation.parents,
                                                     reservation.views, reservation.by_put,
                                                     strict=True)
                  if by_put and view is not None]
        per_message = max(1, PUT_MESSAGE_BYTES // max(1, len(blocks[0].data)))

        def requests() -> Iterator[kvstore_pb2.PutRequest]:
            for start in range(0, len(blocks), per_message):
                yield kvstore_pb2.PutRequest(kv_namespace=self.namespace,
                                             blocks=blocks[start:start + per_message])
        return self._call(self._connected().Put, requests())

    # -- reading -----------------------------------------------------------------------

    def held(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each of `hashes` (one call; nothing is leased)."""
        if not hashes:
            return []
        response = self._call(self._connected().Contains, kvstore_pb2.ContainsRequest(
            kv_namespace=self.namespace, block_hashes=hashes))
        return list(response.present)

    def acquire(self, hashes: Sequence[bytes]) -> Lease:
        """The leading blocks of `hashes` that the store holds, readable until `release`."""
        if not hashes:
            return Lease([], [])
        if self._region is None:
            received = self._get(hashes, prefix_only=True)
            return Lease([b.block_hash for b in received],
                         [memoryview(b.data) for b in received], 0, [None] * len(received))
        response = self._call(self._connected().Acquire, kvstore_pb2.AcquireRequest(
            kv_namespace=self.namespace, region_token=self._token, block_hashes=hashes,
            prefix_only=True))
        lease = Lease([b.block_hash for b in response.blocks], [], response.lease_id)
        elsewhere = {b.block_hash for b in response.blocks if not b.in_region}
        # Blocks not of the slot size are on the store's heap: read them by Get (pinned).
        by_hash = {b.block_hash: b.data for b in self._get(list(elsewhere))} \
            if elsewhere else {}
        for block in response.blocks:
            if block.in_region:
                nbytes = block_nbytes(_dtype_name(block.dtype), block.shape)
                lease.views.append(
                    self._region[block.offset:block.offset + nbytes].toreadonly())
                lease.offsets.append(block.offset)
            elif block.block_hash in by_hash:
                lease.views.append(memoryview(by_hash[block.block_hash]))
                lease.offsets.append(None)
            else:  # cannot happen while pinned; keep the lease a gap-free prefix anyway
                break
        lease.hashes = lease.hashes[:len(lease.views)]
        return lease

    def release(self, lease: Lease) -> None:
        """Let the store evict the lease's blocks again; the views are invalid after it.

        When the store had already ended the lease (held past its lease time), the blocks
        may have been overwritten while read: logged, and counted in `expired_leases`.
        """
        if lease.lease_id:
            response = self._call(self._connected().Release, kvstore_pb2.ReleaseLeaseRequest(
                region_token=self._token, lease_id=lease.lease_id))
            if not response.released:
                self.expired_leases += 1
                _log.warning("kvstore lease %d had expired before release", lease.lease_id)
        _release_views(lease.views)

    def _get(self, hashes: Sequence[bytes], prefix_only: bool = False
             ) -> list[kvstore_pb2.KVBlock]:
        request = kvstore_pb2.GetRequest(kv_namespace=self.namespace, block_hashes=hashes,
                                         prefix_only=prefix_only)
        stub = self._connected()
        return self._call(lambda r, timeout: [b for message in stub.Get(r, timeout=timeout)
                                              for b in message.blocks], request)

    # -- plumbing ----------------------------------------------------------------------

    def _connected(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._stub is None:
            raise KVStoreUnavailable(f"kvstore {self.address}: not connected")
        return self._stub

    def _call(self, method: Callable[..., R], request: Any) -> R:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise KVStoreUnavailable(f"kvstore {self.address}: {code}: {details}") from exc


def _check_block(hashes: Sequence[bytes], parents: Sequence[bytes], dtype: str,
                 shape: tuple[int, ...]) -> None:
    if dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r} (known: {sorted(KV_DTYPE_BYTES)})")
    if len(parents) != len(hashes):
        raise ValueError(f"{len(parents)} parents for {len(hashes)} hashes")
    if not shape or min(shape) <= 0:
        raise ValueError(f"block shape {shape} must be non-empty and positive")


def _dtype_enum(dtype: str) -> kvstore_pb2.KVDType:
    return kvstore_pb2.KVDType.Value("KV_DTYPE_" + dtype.upper())


def _dtype_name(value: kvstore_pb2.KVDType) -> str:
    return kvstore_pb2.KVDType.Name(value).removeprefix("KV_DTYPE_").lower()


def _release_views(views: Sequence[memoryview | None]) -> None:
    """Invalidate views handed out, so a late write or read fails instead of touching a
    slot that may hold another block by now."""
    for view in views:
        if view is not None:
            # A buffer exported from the view (a tensor over it) keeps it: its owner's care.
            with contextlib.suppress(BufferError):
                view.release()
