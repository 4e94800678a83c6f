"""Same-host KV block transfer rates through the kvstore: shared region against bytes.

Driver part: `kv` (KV_PARTS=transfer).

    python loadtest/kvstore_transfer.py --out loadtest/reports/cpu/kvstore_transfer.json
    python loadtest/kvstore_transfer.py --block-bytes 131072 --blocks 64 --out /tmp/kv.json

Starts a kvstore as its own process (or uses `--address`), then, with the worker's client
(services/worker/tier/store_client.py), stores and reads back batches of `--blocks` blocks of
`--block-bytes` (default 2 MiB: one 16-token block of a Llama-3.1-8B-shaped model in bf16)
and reports GB/s of block data, for the shared region (one memory copy each way, offsets
over gRPC) and for the byte path (Put/Get messages). Put: reserve, copy each block into its
buffer, commit. Get: acquire, copy each block out, release. Warm-up batches first touch
every page of the region, so the timed batches measure steady state.

With CUDA, it also reports host-to-device (and device-to-host) copy rates of the same
batches between the mapped region and a device tensor: the region as mapped (pageable),
after `cudaHostRegister`, and an ordinary pinned torch tensor for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshserve.services.worker.tier.store_client import KVStoreClient
from meshserve.shared.grpc_client import GrpcClient, wait_until_serving

NAMESPACE = "bench:bfloat16"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _serving(address: str, timeout_s: float) -> None:
    channel = GrpcClient().channel(address)
    try:
        await wait_until_serving(channel, "meshserve.v1.KVStore", timeout_s=timeout_s)
    finally:
        await channel.close()


@contextlib.contextmanager
def kvstore(address: str | None, capacity_bytes: int) -> Iterator[str]:
    """The address of a serving kvstore: `address`, or a process started for the run."""
    if address is not None:
        yield address
        return
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.services.kvstore",
                             "--port", str(port), "--capacity-bytes", str(capacity_bytes),
                             "--log-level", "WARNING"], env=env)
    try:
        asyncio.run(_serving(f"127.0.0.1:{port}", 60.0))
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Batches:
    """Distinct block hashes per batch, so that every put stores new blocks."""

    def __init__(self, blocks: int, block_bytes: int, tag: str) -> None:
        self.blocks, self.block_bytes, self.tag = blocks, block_bytes, tag
        self.shape = (block_bytes // 2,)  # bfloat16 elements; the layout does not matter here
        self.source = memoryview(bytearray(os.urandom(blocks * block_bytes)))
        self.sink = memoryview(bytearray(blocks * block_bytes))
        self._next = 0

    def hashes(self) -> list[bytes]:
        self._next += 1
        return [f"{self.tag}-{self._next}-{i}".encode().ljust(32, b".") for i in
                range(self.blocks)]

    def block(self, i: int) -> memoryview:
        return self.source[i * self.block_bytes:(i + 1) * self.block_bytes]


def put_batch(client: KVStoreClient, batches: Batches, hashes: list[bytes]) -> None:
    reservation = client.reserve(hashes, [], "bfloat16", batches.shape)
    for i, view in enumerate(reservation.views):
        assert view is not None, "the store refused a block (capacity below one batch?)"
        view[:] = batches.block(i)
    client.commit(reservation)


def get_batch(client: KVStoreClient, batches: Batches, hashes: list[bytes]) -> None:
    lease = client.acquire(hashes)
    assert len(lease.views) == len(hashes), "blocks missing (capacity below one batch?)"
    size = batches.block_bytes
    for i, view in enumerate(lease.views):
        batches.sink[i * size:(i + 1) * size] = view
    client.release(lease)


def measure_path(client: KVStoreClient, batches: Batches, warmup: int, rounds: int
                 ) -> dict[str, float]:
    """Put and get rates in GB/s of block data, over `rounds` batches after `warmup`."""
    for _ in range(warmup):
        hashes = batches.hashes()
        put_batch(client, batches, hashes)
        get_batch(client, batches, hashes)
    put_s = get_s = 0.0
    for _ in range(rounds):
        hashes = batches.hashes()
        start = time.perf_counter()
        put_batch(client, batches, hashes)
        put_s += time.perf_counter() - start
        start = time.perf_counter()
        get_batch(client, batches, hashes)
        get_s += time.perf_counter() - start
    assert bytes(batches.sink) == bytes(batches.source), "blocks came back different"
    total = rounds * batches.blocks * batches.block_bytes
    return {"put_gb_s": total / put_s / 1e9, "get_gb_s": total / get_s / 1e9,
            "put_ms_per_batch": put_s / rounds * 1e3, "get_ms_per_batch": get_s / rounds * 1e3}


def measure_cuda(client: KVStoreClient, batches: Batches, rounds: int) -> dict[str, Any]:
    """Copy rates between the region's blocks and a device tensor, and from a pinned tensor."""
    import torch

    region = client.region
    assert region is not None
    hashes = batches.hashes()
    put_batch(client, batches, hashes)
    lease = client.acquire(hashes)
    offsets = [offset for offset in lease.offsets if offset is not None]
    size, count = batches.block_bytes, len(offsets)
    host = torch.frombuffer(region, dtype=torch.uint8)  # the whole region, no copy
    device = torch.empty(count, size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(count, size, dtype=torch.uint8, pin_memory=True)

    def rate(copy_one: Any) -> float:
        copy_one(0)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(rounds):
            for i in range(count):
                copy_one(i)
        torch.cuda.synchronize()
        return rounds * count * size / (time.perf_counter() - start) / 1e9

    def h2d_region(i: int) -> None:
        device[i].copy_(host[offsets[i]:offsets[i] + size], non_blocking=True)

    def d2h_region(i: int) -> None:
        host[offsets[i]:offsets[i] + size].copy_(device[i], non_blocking=True)

    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    result["h2d_region_pageable_gb_s"] = rate(h2d_region)
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
    result["cuda_host_register"] = int(error)
    if int(error) == 0:
        result["h2d_region_registered_gb_s"] = rate(h2d_region)
        # Writes into the leased (held) blocks: same bytes back, so nothing is corrupted.
        result["d2h_region_registered_gb_s"] = rate(d2h_region)
        cudart.cudaHostUnregister(host.data_ptr())
    result["h2d_pinned_tensor_gb_s"] = rate(lambda i: device[i].copy_(pinned[i],
                                                                      non_blocking=True))
    result["d2h_pinned_tensor_gb_s"] = rate(lambda i: pinned[i].copy_(device[i],
                                                                      non_blocking=True))
    client.release(lease)  # `host` goes with this frame, so the region can be unmapped
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-bytes", type=int, default=2 * 2**20)
    parser.add_argument("--blocks", type=int, default=32, help="blocks per batch")
    parser.add_argument("--rounds", type=int, default=20, help="timed batches per path")
    parser.add_argument("--capacity-bytes", type=int, default=None,
                        help="store capacity (default: 8 batches)")
    parser.add_argument("--address", default=None, help="a running kvstore (default: start one)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    assert args.block_bytes % 2 == 0, "--block-bytes must be even (bfloat16 elements)"
    batch_bytes = args.blocks * args.block_bytes
    capacity = args.capacity_bytes or 8 * batch_bytes
    warmup = -(-capacity // batch_bytes)  # touches every page of the region once

    results: dict[str, Any] = {
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "block_bytes": args.block_bytes,
        "blocks_per_batch": args.blocks, "rounds": args.rounds, "capacity_bytes": capacity}
    with kvstore(args.address, capacity) as address:
        shm = KVStoreClient(address, NAMESPACE, shm=True, timeout_s=60.0)
        shm.connect()
        assert shm.shared_memory, "the region could not be mapped (another host or user?)"
        results["shm"] = measure_path(shm, Batches(args.blocks, args.block_bytes, "shm"),
                                      warmup, args.rounds)
        remote = KVStoreClient(address, NAMESPACE, shm=False, timeout_s=60.0)
        remote.connect()
        results["bytes"] = measure_path(remote, Batches(args.blocks, args.block_bytes, "b"),
                                        warmup, args.rounds)
        remote.close()
        results["cuda"] = None
        with contextlib.suppress(ImportError):
            import torch

            if torch.cuda.is_available():
                results["cuda"] = measure_cuda(
                    shm, Batches(args.blocks, args.block_bytes, "cuda"), args.rounds)
        shm.close()
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
