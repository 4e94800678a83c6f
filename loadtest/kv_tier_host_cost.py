"""Host-side costs of the KV tier per saved block, per probe and per engine step (CPU).

Driver part: none (a CPU benchmark cited by docs/kvstore.md).

    python loadtest/kv_tier_host_cost.py
    python loadtest/kv_tier_host_cost.py --shape 32,2,16,8,128 --blocks 64 --out /tmp/cost.json

Starts a kvstore as its own process on this host (shared memory, as the worker uses it) and
drives the worker's own pieces against it, on the CPU:

- save: `KVTransfer._save` of `--blocks` fresh blocks of `--shape` (default a tiny block,
  so that the memory copies vanish and what is left is the per-block host overhead that a
  GPU's asynchronous copies do not hide), split into reserve, the copy loop and commit;
  wall time and this thread's CPU time (a bound on its time holding the GIL);
- the copy loop's per-block steps on their own (making the slot's tensor, the block's
  bytes, `copy_`);
- probe: one `client.acquire` (a miss, and a hit of `--blocks` blocks), and `--probes`
  ProbeJobs submitted at once to a running transfer thread (until the last answer);
- step: `KVTier.save_new_blocks` on the engine thread with `--blocks` new blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvstore_transfer import kvstore

from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.tier import transfer as kv_transfer
from meshserve.services.worker.tier.kv_tier import KVTier, ProbeDone, ProbeJob, SaveJob
from meshserve.services.worker.tier.store_client import KVStoreClient
from meshserve.services.worker.tier.transfer import KVTransfer

NAMESPACE = "cost:bfloat16"


def kv_caches(shape: tuple[int, ...], num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Views of one storage tensor, as the model runner allocates them."""
    layers, _, block_size, heads, dim = shape
    storage = torch.randn(layers, 2, num_blocks, block_size, heads, dim).to(torch.bfloat16)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(layers)]


class Hashes:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[bytes]:
        self.next += n
        return [f"cost-{self.next}-{i}".encode().ljust(32, b".") for i in range(n)]


def per_call_us(fn: Callable[[], object], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1e6


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure_save(transfer: KVTransfer, client: KVStoreClient, hashes: Hashes, blocks: int,
                 reps: int) -> dict[str, float]:
    data = torch.stack([torch.randn(transfer.block_shape).to(torch.bfloat16)
                        for _ in range(blocks)])
    spent: dict[str, list[float]] = {"reserve": [], "commit": []}
    reserve, commit = client.reserve, client.commit

    def spy(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name].append(time.perf_counter() - started)
        return call

    client.reserve = spy("reserve", reserve)  # type: ignore[method-assign]
    client.commit = spy("commit", commit)  # type: ignore[method-assign]
    walls, cpus = [], []
    try:
        for _ in range(reps):
            job = SaveJob(hashes.take(blocks), [], data, None)
            wall, cpu = timed(lambda job=job: transfer._save(client, job))
            walls.append(wall)
            cpus.append(cpu)
    finally:
        client.reserve, client.commit = reserve, commit  # type: ignore[method-assign]
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    rpc = statistics.median(spent["reserve"]) + statistics.median(spent["commit"])
    return {"job_wall_us": wall * 1e6, "job_cpu_us": cpu * 1e6,
            "reserve_us": statistics.median(spent["reserve"]) * 1e6,
            "commit_us": statistics.median(spent["commit"]) * 1e6,
            "copy_loop_per_block_us": (wall - rpc) / blocks * 1e6,
            "wall_per_block_us": wall / blocks * 1e6, "cpu_per_block_us": cpu / blocks * 1e6}


def measure_block_steps(transfer: KVTransfer, client: KVStoreClient, hashes: Hashes,
                        reps: int) -> dict[str, float]:
    """One block's copy into its slot: a tensor made over the slot's view (with the warning
    filter that a read-only view needs) against a slice of one tensor over the region."""
    reservation = client.reserve(hashes.take(1), [], transfer.dtype_name, transfer.block_shape)
    view, offset = reservation.views[0], reservation.offsets[0]
    assert view is not None and offset is not None, "the store refused a block"
    region = kv_transfer._as_bytes_tensor(client.region)  # type: ignore[arg-type]
    data = torch.randn((1, *transfer.block_shape)).to(torch.bfloat16)
    rows = data.reshape(1, -1).view(torch.uint8)
    target, source = region[offset:offset + view.nbytes], rows[0]
    out = {"tensor_over_view_us": per_call_us(lambda: kv_transfer._as_bytes_tensor(view), reps),
           "frombuffer_only_us": per_call_us(
               lambda: torch.frombuffer(view, dtype=torch.uint8), reps),
           "region_slice_us": per_call_us(lambda: region[offset:offset + view.nbytes], reps),
           "flat_block_us": per_call_us(lambda: data[0].reshape(-1).view(torch.uint8), reps),
           "row_of_job_us": per_call_us(lambda: rows[0], reps),
           "copy_us": per_call_us(lambda: target.copy_(source, non_blocking=True), reps)}
    client.abandon(reservation)
    return out


def measure_probes(transfer: KVTransfer, client: KVStoreClient, hashes: Hashes, blocks: int,
                   probes: int, reps: int) -> dict[str, float]:
    held = hashes.take(blocks)
    data = torch.stack([torch.randn(transfer.block_shape).to(torch.bfloat16)
                        for _ in range(blocks)])
    transfer._save(client, SaveJob(held, [], data, None))
    missing = hashes.take(blocks)

    def probe(asked: list[bytes]) -> None:
        client.release(client.acquire(asked))

    out = {"acquire_miss_us": per_call_us(lambda: client.acquire(missing), reps),
           "acquire_hit_and_release_us": per_call_us(lambda: probe(held), reps)}
    transfer._thread.start()
    started = time.perf_counter()
    for i in range(probes):
        transfer.submit(ProbeJob(f"r{i}", hashes.take(blocks)))
    answered = 0
    while answered < probes:
        transfer.wait(1.0)
        answered += sum(isinstance(d, ProbeDone) for d in transfer.take_done())
    out[f"{probes}_probes_until_last_ms"] = (time.perf_counter() - started) * 1e3
    return out


class NullTransport:
    """The engine's view of a transfer thread that takes every job and does nothing."""

    available = True
    save_backlog_bytes = 0

    def submit(self, job: object) -> None:
        pass


def measure_step(shape: tuple[int, ...], hashes: Hashes, blocks: int, reps: int
                 ) -> dict[str, float]:
    caches = kv_caches(shape, 4 * blocks)
    kv = KVCacheManager(4 * blocks, shape[2])
    transport = NullTransport()
    tier = KVTier(kv, caches, transport, max_save_backlog_bytes=1 << 40)  # type: ignore[arg-type]
    walls = []
    for _ in range(reps):
        new = hashes.take(blocks)
        kv.pool._new_cached = [(i * 3 % (4 * blocks), h, None) for i, h in enumerate(new)]
        walls.append(timed(tier.save_new_blocks)[0])
    return {"save_new_blocks_us": statistics.median(walls) * 1e6,
            "save_new_blocks_nothing_new_us": per_call_us(tier.save_new_blocks, reps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2,2,16,1,8",
                        help="layers,2,block_size,kv_heads,head_dim of one block")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per save job / probe")
    parser.add_argument("--probes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    torch.set_num_threads(1)
    block_bytes = 2 * int(torch.tensor(shape).prod())
    capacity = max(64 << 20, block_bytes * args.blocks * (args.reps + 8) * 2)
    hashes = Hashes()
    with kvstore(None, capacity) as address:
        caches = kv_caches(shape, 4)
        transfer = KVTransfer(lambda: KVStoreClient(address, NAMESPACE), caches)
        transfer._connect()
        client = transfer._client
        assert client is not None and client.shared_memory, "no shared region with the store"
        result = {"shape": list(shape), "block_bytes": block_bytes, "blocks": args.blocks,
                  "save": measure_save(transfer, client, hashes, args.blocks, args.reps),
                  "block_steps": measure_block_steps(transfer, client, hashes, 10 * args.reps),
                  "probe": measure_probes(transfer, client, hashes, args.blocks, args.probes,
                                          args.reps),
                  "step": measure_step(shape, hashes, args.blocks, args.reps)}
        transfer.stop()
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
