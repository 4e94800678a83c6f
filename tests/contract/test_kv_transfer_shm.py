"""The worker's transfer thread against a real grpc.aio kvstore on 127.0.0.1 through its
shared region: saved blocks land in the store byte for byte, and a probe and a load put
them back into other cache blocks exactly (CPU caches, bfloat16)."""

from __future__ import annotations

import asyncio
import threading

import torch

from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.kvstore.service import KVStoreService
from meshserve.services.worker.engine.kv_copy import gather_blocks
from meshserve.services.worker.tier.kv_tier import (
    LoadDone,
    LoadJob,
    ProbeDone,
    ProbeJob,
    SaveJob,
    TransferDone,
)
from meshserve.services.worker.tier.store_client import KVStoreClient
from meshserve.services.worker.tier.transfer import KVTransfer

NS = "tiny:bfloat16"
LAYERS, BLOCK_SIZE, HEADS, DIM, NUM_BLOCKS = 2, 4, 2, 8, 8
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * HEADS * DIM * 2


def h(i: int) -> bytes:
    return f"block-{i}".encode().ljust(32, b".")


def make_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Views of one storage tensor, as the model runner allocates them."""
    storage = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM).to(torch.bfloat16)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(LAYERS)]


def next_done(transfer: KVTransfer) -> TransferDone:
    for _ in range(100):
        done = transfer.take_done()
        if done:
            assert len(done) == 1, f"one job at a time, got {done}"
            return done[0]
        transfer.wait(0.1)
    raise AssertionError("the transfer thread did not answer")


async def test_blocks_saved_through_the_region_load_back_exactly() -> None:
    service = await KVStoreService.start(KVStoreConfig(
        port=0, redis_url="", store_id="s0", capacity_bytes=16 * BLOCK_BYTES, drain_grace_s=0))
    address = f"127.0.0.1:{service.port}"
    caches = make_caches()
    transfer = KVTransfer(lambda: KVStoreClient(address, NS), caches, retry_s=0.0)
    reader = KVStoreClient(address, NS)
    try:
        await asyncio.to_thread(transfer.start)
        await asyncio.to_thread(reader.connect)
        assert reader.shared_memory, "the test means the shared region"
        saved = gather_blocks(caches, [5, 1, 6])  # [3, layers, 2, block_size, heads, dim]
        transfer.submit(SaveJob([h(0), h(1), h(2)], [b"", h(0), h(1)], saved, None))
        assert await asyncio.to_thread(transfer.flush, 10)
        assert transfer.stats.saved_blocks == 3
        assert transfer.stats.saved_bytes == 3 * BLOCK_BYTES

        lease = await asyncio.to_thread(reader.acquire, [h(0), h(1), h(2)])
        assert [bytes(view) for view in lease.views] == [
            saved[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(3)]
        await asyncio.to_thread(reader.release, lease)

        transfer.submit(ProbeJob("r", [h(0), h(1), h(9)]))
        probed = await asyncio.to_thread(next_done, transfer)
        assert isinstance(probed, ProbeDone) and probed.num_found == 2
        transfer.submit(LoadJob("r", probed.lease, [2, 3], None))
        loaded = await asyncio.to_thread(next_done, transfer)
        assert loaded == LoadDone("r", True)
        assert torch.equal(gather_blocks(caches, [2, 3]).view(torch.uint8),
                           saved[:2].view(torch.uint8))
    finally:
        await asyncio.to_thread(transfer.stop)
        reader.close()
        await service.stop(grace_s=0)


class CountingClient(KVStoreClient):
    """The real client, counting the store calls a probe makes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.acquires = 0
        self.helds = 0

    def acquire(self, hashes):  # type: ignore[no-untyped-def]
        self.acquires += 1
        return super().acquire(hashes)

    def held(self, hashes):  # type: ignore[no-untyped-def]
        self.helds += 1
        return super().held(hashes)


async def test_queued_probes_ask_once_and_lease_only_what_the_store_holds() -> None:
    service = await KVStoreService.start(KVStoreConfig(
        port=0, redis_url="", store_id="s0", capacity_bytes=16 * BLOCK_BYTES, drain_grace_s=0))
    address = f"127.0.0.1:{service.port}"
    clients: list[CountingClient] = []

    def factory() -> CountingClient:
        clients.append(CountingClient(address, NS))
        return clients[-1]

    caches = make_caches()
    transfer = KVTransfer(factory, caches, retry_s=0.0)
    try:
        await asyncio.to_thread(transfer.start)
        saved = gather_blocks(caches, [5, 1, 6])
        transfer.submit(SaveJob([h(0), h(1), h(2)], [b"", h(0), h(1)], saved, None))
        assert await asyncio.to_thread(transfer.flush, 10)
        # Hold the thread while a burst of probes queues up behind it.
        busy, release = threading.Event(), threading.Event()
        transfer.call(lambda: (busy.set(), release.wait(10)))
        assert await asyncio.to_thread(busy.wait, 10)
        asked = {"a": [h(0), h(1), h(9)], "b": [h(5)], "c": [h(1), h(2)], "d": [h(7), h(8)],
                 "e": [h(0)], "f": []}
        for request_id, hashes in asked.items():
            transfer.submit(ProbeJob(request_id, hashes))
        client = clients[-1]
        before = (client.acquires, client.helds)
        release.set()
        answers = {}
        while len(answers) < len(asked):
            done = await asyncio.to_thread(lambda: (transfer.wait(1.0), transfer.take_done())[1])
            for item in done:
                assert isinstance(item, ProbeDone)
                answers[item.request_id] = item
        assert {r: a.num_found for r, a in answers.items()} == {
            "a": 2, "b": 0, "c": 2, "d": 0, "e": 1, "f": 0}
        # One question for the whole burst; leases only where the first block is held.
        assert (client.acquires - before[0], client.helds - before[1]) == (3, 1)
        assert transfer.stats.probe_hits == 5
        for item in answers.values():  # the leases go back on the thread, as DropJob's do
            if item.lease is not None:
                transfer.call(lambda lease=item.lease: client.release(lease))
        assert await asyncio.to_thread(transfer.flush, 10)
    finally:
        await asyncio.to_thread(transfer.stop)
        await service.stop(grace_s=0)
