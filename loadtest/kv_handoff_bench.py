"""GB/s of the TCP KV handoff between two processes: a prefill worker's held blocks pulled.

    python loadtest/kv_handoff_bench.py --out loadtest/reports/disagg/kv_handoff_tcp.json
    python loadtest/kv_handoff_bench.py --tokens 4096 --streams 1,4 --repeats 2

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

from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer, probe, pull

TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # the 8B shape in bf16: 128 KiB per token
BLOCK_TOKENS = 16


def hashes_of(run: int, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{run}/{i}".encode()).digest() for i in range(count)]


def serve(conn: Connection, block_bytes: int, max_blocks: int) -> None:
    """The prefill side: hold `count` blocks under run `run`'s hashes when asked."""
    blocks = [torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
              for _ in range(max_blocks)]
    holder = BlockHolder(2 * max_blocks * block_bytes, 600.0)
    server = BlockServer(holder, "127.0.0.1")
    server.start()
    conn.send(server.port)
    while (asked := conn.recv()) is not None:
        run, count = asked
        for block_hash, data in zip(hashes_of(run, count), blocks, strict=False):
            holder.put(block_hash, data)
        conn.send(holder.held_bytes)
    server.stop()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--streams", default="1,2,4,8", help="parallel connections to try")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    stream_counts = [int(s) for s in args.streams.split(",")]
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
    report = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "block_bytes": block_bytes, "token_bytes": TOKEN_BYTES, "results": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
