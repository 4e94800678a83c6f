"""GB/s of the KV handoff between two processes: a prefill worker's held blocks pulled.

    python loadtest/kv_handoff_bench.py --out loadtest/reports/disagg/kv_handoff_tcp.json
    python loadtest/kv_handoff_bench.py --tokens 4096 --streams 1,4 --repeats 2
    python loadtest/kv_handoff_bench.py --into-cache cuda:1 --source-device cuda:0 \
        --transports ipc,tcp --out kv_handoff_gpu.json

A server process holds a prompt's KV blocks in a BlockHolder and serves them with the
worker's BlockServer (services/worker/tier/tcp_blocks.py); this process pulls them with the
decode worker's `pull`, over 1, 2, 4 and 8 parallel connections, into one buffer allocated
before the runs (as the decode worker allocates first). The default shape is
Llama-3.1-8B's KV in bf16: 32 layers x 2 (K, V) x 8 KV heads x 128 head dim x 2 bytes =
128 KiB per token, 16-token blocks of 2 MiB, for 4k- and 8k-token prompts (512 MiB and 1
GiB). Each run times the pull alone (the server re-holds the same tensors under new hashes
between runs, untimed); GB/s is 1e9 bytes per second of block data, the best and the
median of `--repeats` runs. The server process is this script again (`--serve`), talking
to its parent over a pipe; loopback TCP, so the figure is the machine's copy and socket
cost, not a network's.

`--into-cache DEVICE` times the decode worker's whole load instead, through its own
transport (TcpTransfer: probe, then the load into blocks of a paged cache of the 8B shape
on DEVICE, waited for on its stream): `ipc` with the server's blocks in a SlotPool on
`--source-device` (mapped here through CUDA IPC, or shared memory on a CPU: a gather over
the link into the cache), `tcp` with them in host memory (pulled over `--streams`
connections into page-locked memory, then copied up and scattered). GB/s counts block
bytes over the time from the load's submission to its completion.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from meshserve.services.worker.tier.kv_tier import LoadDone, LoadJob, ProbeDone, ProbeJob
from meshserve.services.worker.tier.slot_pool import HEADER_BYTES, SlotPool
from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer, probe, pull
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # the 8B shape
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # in bf16: 128 KiB per token
BLOCK_TOKENS = 16


def hashes_of(run: int, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{run}/{i}".encode()).digest() for i in range(count)]


def serve(conn: Connection, block_bytes: int, max_blocks: int, pool_device: str = "") -> None:
    """The prefill side: hold `count` blocks under run `run`'s hashes when asked (host
    memory, or a SlotPool's slots on `pool_device`)."""
    device = torch.device(pool_device or "cpu")
    blocks = [torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, device=device)
              for _ in range(max_blocks)]
    pool = None
    if pool_device:
        pool = SlotPool(HEADER_BYTES + 2 * max_blocks * block_bytes, device)
        pool.carve(block_bytes)
    holder = BlockHolder(2 * max_blocks * block_bytes, 600.0,
                         release=pool.release if pool is not None else None)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    conn.send(server.port)
    while (asked := conn.recv()) is not None:
        run, count = asked
        for block_hash, data in zip(hashes_of(run, count), blocks, strict=False):
            if pool is None:
                holder.put(block_hash, data)
                continue
            slot = pool.allocate()
            while slot is None and holder.evict_oldest():
                slot = pool.allocate()
            assert slot is not None, "the pool has room for two prompts"
            slot.copy_(data)
            holder.put(block_hash, slot)
        if pool is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send(holder.held_bytes)
    server.stop()
    if pool is not None:
        pool.close()


def measure(conn: Connection, address: str, pool: ThreadPoolExecutor, out: torch.Tensor,
            tokens: int, streams: int, repeats: int, first_run: int) -> dict[str, Any]:
    """`repeats` timed pulls of a `tokens`-token prompt over `streams` connections."""
    count = tokens // BLOCK_TOKENS
    rates: list[float] = []
    for run in range(first_run, first_run + repeats):
        conn.send((run, count))
        conn.recv()
        hashes = hashes_of(run, count)
        assert probe(address, hashes, 10.0) == count, "the server does not hold the blocks"
        started = time.perf_counter()
        assert pull(address, hashes, out[:count], pool, streams, 60.0), "a pull failed"
        rates.append(count * out.shape[1] / (time.perf_counter() - started) / 1e9)
    return {"tokens": tokens, "streams": streams, "bytes": count * out.shape[1],
            "gb_per_s_best": round(max(rates), 3),
            "gb_per_s_median": round(statistics.median(rates), 3), "runs": len(rates)}


def paged_cache(blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A paged KV cache of the 8B shape in bf16, layers as views of one tensor (as the
    model runner lays it out)."""
    base = torch.zeros((LAYERS, 2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM),
                       dtype=torch.bfloat16, device=device)
    return [(base[layer, 0], base[layer, 1]) for layer in range(LAYERS)]


def load_once(transfer: TcpTransfer, address: str, hashes: list[bytes]) -> float:
    """The decode worker's probe and load of `hashes`; seconds of the load alone."""
    transfer.expect("bench", address)
    transfer.submit(ProbeJob("bench", hashes))
    probed = next_done(transfer)
    assert isinstance(probed, ProbeDone) and probed.num_found == len(hashes), probed
    started = time.perf_counter()
    transfer.submit(LoadJob("bench", probed.lease, list(range(1, len(hashes) + 1)), None))
    loaded = next_done(transfer)
    elapsed = time.perf_counter() - started
    assert isinstance(loaded, LoadDone) and loaded.ok, "the load failed"
    return elapsed


def next_done(transfer: TcpTransfer) -> object:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = transfer.take_done()
        if done:
            assert len(done) == 1, done
            return done[0]
        transfer.wait(1.0)
    raise TimeoutError("the transfer did not finish in 120 s")


def measure_into_cache(args: argparse.Namespace, lengths: list[int], streams: int,
                       transport: str) -> list[dict[str, Any]]:
    """The decode worker's load (`load_once`) of each length, `repeats` times."""
    block_bytes = BLOCK_TOKENS * TOKEN_BYTES
    max_blocks = max(lengths) // BLOCK_TOKENS
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    pool_device = args.source_device if transport == "ipc" else ""
    server = spawn.Process(target=serve, args=(child, block_bytes, max_blocks, pool_device),
                           daemon=True)
    server.start()
    address = f"127.0.0.1:{parent.recv()}"
    transfer = TcpTransfer(paged_cache(max_blocks + 1, torch.device(args.into_cache)),
                           streams=streams, timeout_s=60.0)
    transfer.start()
    runs = iter(range(1 << 30))

    def timed(count: int) -> float:
        run = next(runs)
        parent.send((run, count))
        parent.recv()
        return count * block_bytes / load_once(transfer, address, hashes_of(run, count)) / 1e9

    timed(lengths[0] // BLOCK_TOKENS)  # warm-up: the mapping, the allocator, the kernels
    results: list[dict[str, Any]] = []
    for tokens in lengths:
        count = tokens // BLOCK_TOKENS
        rates = [timed(count) for _ in range(args.repeats)]
        results.append({"transport": transport, "tokens": tokens, "streams": streams,
                        "device": args.into_cache, "source_device": pool_device or "host",
                        "bytes": count * block_bytes,
                        "mapped_blocks": transfer.stats.mapped_blocks,
                        "gb_per_s_best": round(max(rates), 3),
                        "gb_per_s_median": round(statistics.median(rates), 3),
                        "runs": len(rates)})
        print(json.dumps(results[-1]), flush=True)
    transfer.stop()
    parent.send(None)
    server.join(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--streams", default="1,2,4,8", help="parallel connections to try")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--into-cache", default="", metavar="DEVICE",
                        help="time the decode worker's load into a paged cache on DEVICE")
    parser.add_argument("--source-device", default="cuda:0",
                        help="with --into-cache: where the ipc transport's pool lives")
    parser.add_argument("--transports", default="ipc,tcp",
                        help="with --into-cache: ipc, tcp or both")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    stream_counts = [int(s) for s in args.streams.split(",")]
    if args.into_cache:
        results = []
        for transport in args.transports.split(","):
            for streams in stream_counts if transport == "tcp" else stream_counts[-1:]:
                results += measure_into_cache(args, lengths, streams, transport)
    else:
        results = measure_pulls(args, lengths, stream_counts)
    report = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "gpus": gpu_names()},
              "block_bytes": BLOCK_TOKENS * TOKEN_BYTES, "token_bytes": TOKEN_BYTES,
              "results": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def gpu_names() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def measure_pulls(args: argparse.Namespace, lengths: list[int],
                  stream_counts: list[int]) -> list[dict[str, Any]]:
    """Raw pulls into one host buffer (no cache), over each stream count."""
    block_bytes = BLOCK_TOKENS * TOKEN_BYTES
    max_blocks = max(lengths) // BLOCK_TOKENS
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    server = spawn.Process(
        target=serve, args=(child, block_bytes, max_blocks), daemon=True)
    server.start()
    address = f"127.0.0.1:{parent.recv()}"
    out = torch.empty((max_blocks, block_bytes), dtype=torch.uint8)
    out.fill_(0)  # every page touched before the first timed run
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max(stream_counts)) as pool:
        measure(parent, address, pool, out, lengths[0], 1, 1, 0)  # warm-up
        for tokens in lengths:
            for streams in stream_counts:
                result = measure(parent, address, pool, out, tokens, streams, args.repeats,
                                 1 + len(results) * args.repeats)
                results.append(result)
                print(json.dumps(result), flush=True)
    parent.send(None)
    server.join(timeout=30)
    return results


if __name__ == "__main__":
    main()
