"""Contract tests of the kvstore's same-host path and the worker's blocking client: a real
grpc.aio kvstore on 127.0.0.1 (in this process, or as its own process), real Redis.

The client is synchronous (it runs on the worker's transfer thread), so the tests call it
through `asyncio.to_thread` while the event loop serves the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from meshserve.proto.v1 import kvstore_pb2, kvstore_pb2_grpc
from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.service import SERVICE_NAME, KVStoreService
from meshserve.services.worker.tier.store_client import KVStoreClient, KVStoreUnavailable, Lease
from meshserve.shared.grpc_client import GrpcClient, wait_until_serving
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.kv_region import HEADER_BYTES

NS = "tiny:bfloat16"
HOLDER = "kvstore:s0"
SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # bfloat16: 512 bytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return hashlib.sha256(f"kv-{i}".encode()).digest()


def parent(i: int) -> bytes:
    return h(i - 1) if i else b""


def data(i: int) -> bytes:
    return hashlib.shake_256(f"data-{i}".encode()).digest(BLOCK_BYTES)


Started = tuple[KVStoreService, kvstore_pb2_grpc.KVStoreStub]


@pytest.fixture
async def start_store(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[Started]]]:
    """Starts in-process kvstores publishing to the test's Redis; stops them afterwards."""
    running: list[tuple[KVStoreService, grpc.aio.Channel]] = []

    async def start(clock: Callable[[], float] | None = None, **overrides: Any) -> Started:
        config = KVStoreConfig(**{"port": 0, "redis_url": redis_url, "store_id": "s0",
                                  "capacity_bytes": 16 * BLOCK_BYTES, "drain_grace_s": 0,
                                  **overrides})
        service = await KVStoreService.start(config, **({"clock": clock} if clock else {}))
        channel = GrpcClient().channel(f"127.0.0.1:{service.port}")
        running.append((service, channel))
        return service, kvstore_pb2_grpc.KVStoreStub(channel)

    yield start
    for service, channel in running:
        await channel.close()
        await service.stop(grace_s=0)


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., Awaitable[KVStoreClient]]]:
    """Connected clients of a store's port, closed afterwards."""
    made: list[KVStoreClient] = []

    async def connect(port: int, **kwargs: Any) -> KVStoreClient:
        client = KVStoreClient(f"127.0.0.1:{port}", NS, **kwargs)
        made.append(client)
        await asyncio.to_thread(client.connect)
        return client

    yield connect
    for client in made:
        client.close()


async def store_blocks(client: KVStoreClient, ids: Sequence[int]) -> int:
    """Reserve, write and commit blocks `ids` (a chain, head first); blocks newly held."""
    reservation = await asyncio.to_thread(client.reserve, [h(i) for i in ids],
                                          [parent(i) for i in ids], "bfloat16", SHAPE)
    for i, view in zip(ids, reservation.views, strict=True):
        if view is not None:
            view[:] = data(i)
    return await asyncio.to_thread(client.commit, reservation)


async def read_blocks(client: KVStoreClient, ids: Sequence[int]) -> tuple[Lease, list[bytes]]:
    lease = await asyncio.to_thread(client.acquire, [h(i) for i in ids])
    return lease, [bytes(view) for view in lease.views]


async def stats(stub: kvstore_pb2_grpc.KVStoreStub) -> kvstore_pb2.StatsResponse:
    return await stub.Stats(kvstore_pb2.StatsRequest())


async def test_blocks_written_in_place_read_back_in_place(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    service, stub = await start_store()
    client = await clients(service.port)
    assert client.shared_memory and client.store_id == "s0"
    assert client.region is not None and len(client.region) == HEADER_BYTES + 16 * BLOCK_BYTES

    assert await store_blocks(client, [0, 1, 2, 3]) == 4
    assert await store_blocks(client, [2, 3, 4]) == 1  # 2 and 3 were held: no view
    s = await stats(stub)
    assert (s.num_blocks, s.slot_bytes, s.reservations, s.stored) == (5, BLOCK_BYTES, 0, 5)

    lease, got = await read_blocks(client, [0, 1, 2, 9, 4])
    assert lease.hashes == [h(0), h(1), h(2)]  # the leading blocks held
    assert got == [data(0), data(1), data(2)]
    assert all(view.readonly for view in lease.views)
    offset = lease.offsets[1]
    assert offset is not None and bytes(client.region[offset:offset + BLOCK_BYTES]) == data(1)
    assert lease.lease_id and (await stats(stub)).pinned_blocks == 3
    await asyncio.to_thread(client.release, lease)
    s = await stats(stub)
    assert (s.leases, s.pinned_blocks) == (0, 0) and client.expired_leases == 0
    assert (await asyncio.to_thread(client.acquire, [h(7)])).hashes == []

    # A worker pins the region through a buffer export (a tensor over it): closing with the
    # export alive leaves the mapping to the export instead of failing.
    exported = np.frombuffer(client.region, dtype=np.uint8)
    client.close()
    assert not client.shared_memory and bytes(exported[offset:offset + 4]) == data(1)[:4]


async def test_the_byte_path_and_the_shared_region_see_the_same_blocks(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    service, stub = await start_store()
    shm = await clients(service.port)
    remote = await clients(service.port, shm=False)
    assert shm.shared_memory and not remote.shared_memory and remote.region is None

    await store_blocks(shm, [0, 1])
    lease, got = await read_blocks(remote, [0, 1])  # Get of blocks written in place
    assert (lease.lease_id, got) == (0, [data(0), data(1)])
    await asyncio.to_thread(remote.release, lease)

    reservation = await asyncio.to_thread(remote.reserve, [h(1), h(2), h(3)],
                                          [h(0), h(1), h(2)], "bfloat16", SHAPE)
    assert reservation.views[0] is None  # held: not sent again
    assert await store_blocks(remote, [1, 2, 3]) == 2  # Put into slots
    lease, got = await read_blocks(shm, [0, 1, 2, 3])
    assert got == [data(i) for i in range(4)] and lease.lease_id
    await asyncio.to_thread(shm.release, lease)

    request = kvstore_pb2.GetRequest(kv_namespace=NS, block_hashes=[h(3)])
    [message] = [m async for m in stub.Get(request)]
    assert (message.blocks[0].data, message.blocks[0].parent_hash) == (data(3), h(2))


async def test_blocks_of_another_size_travel_as_bytes_beside_the_slots(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    service, stub = await start_store()
    client = await clients(service.port)
    await store_blocks(client, [0])  # fixes the slot size
    small = (2, 2, 4, 2, 4)  # 256 bytes
    reservation = await asyncio.to_thread(client.reserve, [h(50)], [b""], "bfloat16", small)
    assert reservation.reservation_id == 0 and reservation.by_put == [True]
    view = reservation.views[0]
    assert view is not None and len(view) == 256
    view[:] = bytes(range(256))
    assert await asyncio.to_thread(client.commit, reservation) == 1
    lease, got = await read_blocks(client, [50])
    assert got == [bytes(range(256))] and lease.lease_id  # pinned, read by Get
    await asyncio.to_thread(client.release, lease)
    assert (await stats(stub)).used_bytes == BLOCK_BYTES + 256


async def test_eviction_skips_leased_blocks_and_the_index_follows(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]],
        redis_client: aioredis.Redis) -> None:
    service, stub = await start_store(capacity_bytes=4 * BLOCK_BYTES)
    client = await clients(service.port)
    await store_blocks(client, [0, 1, 2, 3])
    index = KVIndex(redis_client, NS)
    assert await index.blocks_of(HOLDER) == {h(i) for i in range(4)}
    assert await index.match_prefix([h(i) for i in range(4)]) == {HOLDER: 4}

    tail, _ = await read_blocks(client, [3])  # leased
    refresh, _ = await read_blocks(client, [0, 1, 2])
    await asyncio.to_thread(client.release, refresh)  # 3 is the least recent now
    assert await store_blocks(client, [10, 11]) == 2
    assert await index.blocks_of(HOLDER) == {h(0), h(3), h(10), h(11)}  # 2 and 1 went
    assert (await stats(stub)).evictions == 2

    everything, got = await read_blocks(client, [3, 0, 10, 11])
    assert got == [data(3), data(0), data(10), data(11)]
    reservation = await asyncio.to_thread(client.reserve, [h(20)], [b""], "bfloat16", SHAPE)
    assert reservation.views == [None]  # all pinned: refused, nothing evicted
    await asyncio.to_thread(client.abandon, reservation)
    assert (await stats(stub)).evictions == 2
    await asyncio.to_thread(client.release, everything)
    await asyncio.to_thread(client.release, tail)
    assert await store_blocks(client, [20]) == 1
    # The read made 3 the most recent and 11 the least; unpinned, 11 goes.
    assert await index.blocks_of(HOLDER) == {h(0), h(3), h(10), h(20)}


async def test_unreleased_leases_and_reservations_expire(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    clock = FakeClock()
    service, stub = await start_store(clock=clock, capacity_bytes=2 * BLOCK_BYTES, lease_s=30)
    client = await clients(service.port)
    await store_blocks(client, [0])
    lease, _ = await read_blocks(client, [0])
    reservation = await asyncio.to_thread(client.reserve, [h(1)], [h(0)], "bfloat16", SHAPE)
    assert reservation.views[0] is not None
    assert (await stats(stub)).used_bytes == 2 * BLOCK_BYTES

    clock.now += 30  # the client "died" holding both
    s = await stats(stub)
    assert (s.leases, s.reservations, s.expired, s.used_bytes) == (0, 0, 2, BLOCK_BYTES)
    assert await asyncio.to_thread(client.commit, reservation) == 0  # expired: not stored
    await asyncio.to_thread(client.release, lease)
    assert client.expired_leases == 1
    assert await store_blocks(client, [5, 6]) == 2  # block 0 is evictable again
    assert (await stats(stub)).num_blocks == 2


async def test_a_store_restart_is_unavailable_until_connect(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    first, _ = await start_store()
    port = first.port
    client = await clients(port)
    await store_blocks(client, [0])
    old_region = client.region
    await first.stop(grace_s=0)
    second, _ = await start_store(port=port)  # same address, new region, empty
    assert await asyncio.to_thread(client.wait_ready, 10.0)  # the old channel is back
    with pytest.raises(KVStoreUnavailable, match="restarted"):  # offsets of the old region
        await asyncio.to_thread(client.reserve, [h(1)], [b""], "bfloat16", SHAPE)
    with pytest.raises(KVStoreUnavailable, match="restarted"):
        await asyncio.to_thread(client.acquire, [h(0)])

    await asyncio.to_thread(client.connect)
    assert client.shared_memory and client.region is not old_region
    assert await store_blocks(client, [1]) == 1
    _, got = await read_blocks(client, [1])
    assert got == [data(1)]

    await second.stop(grace_s=0)  # down: every call fails at once
    with pytest.raises(KVStoreUnavailable, match="UNAVAILABLE"):
        await asyncio.to_thread(client.acquire, [h(1)])
    await start_store(port=port)
    await asyncio.to_thread(client.connect)
    assert await store_blocks(client, [1]) == 1


async def test_a_store_without_a_region_serves_the_same_calls_by_bytes(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    service, stub = await start_store(shm="off")
    client = await clients(service.port)
    assert not client.shared_memory
    assert await store_blocks(client, [0, 1]) == 2
    _, got = await read_blocks(client, [0, 1])
    assert got == [data(0), data(1)] and (await stats(stub)).slot_bytes == 0


async def test_a_host_without_memfd_serves_by_bytes(
        start_store: Callable[..., Awaitable[Started]],
        clients: Callable[..., Awaitable[KVStoreClient]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "memfd_create")  # as on a platform that lacks it
    service, _ = await start_store()
    assert service.arena is None
    client = await clients(service.port)
    assert not client.shared_memory
    assert await store_blocks(client, [0]) == 1


async def test_an_unreachable_store_raises_quickly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = KVStoreClient(f"127.0.0.1:{port}", NS, timeout_s=2.0)
    with pytest.raises(KVStoreUnavailable, match="UNAVAILABLE"):
        await asyncio.to_thread(client.connect)
    with pytest.raises(KVStoreUnavailable, match="not connected"):
        client.acquire([h(0)])
    client.close()


async def _run_store_process(port: int) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshserve.services.kvstore", "--port", str(port),
        "--capacity-bytes", str(16 * BLOCK_BYTES), "--drain-grace-s", "0", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    try:
        await wait_until_serving(channel, SERVICE_NAME, timeout_s=60)
    finally:
        await channel.close()
    return proc


async def test_a_store_process_is_mapped_from_another_process_and_outlived(
        clients: Callable[..., Awaitable[KVStoreClient]]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = await _run_store_process(port)
    try:
        client = await clients(port)
        assert client.shared_memory  # through /proc/<its pid>/fd of another process
        assert await store_blocks(client, [0, 1]) == 2
        lease, got = await read_blocks(client, [0, 1])
        assert got == [data(0), data(1)]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        assert bytes(lease.views[0]) == data(0)  # the mapping outlives the store
        with pytest.raises(KVStoreUnavailable):
            await asyncio.to_thread(client.release, lease)

        proc = await _run_store_process(port)
        await asyncio.to_thread(client.connect)
        assert client.shared_memory
        assert (await asyncio.to_thread(client.acquire, [h(0)])).hashes == []  # empty
        assert await store_blocks(client, [0]) == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
