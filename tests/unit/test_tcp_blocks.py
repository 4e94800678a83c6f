"""KV blocks over raw TCP (services/worker/tier/tcp_blocks.py), over real sockets on 127.0.0.1:
blocks pulled over several streams arrive bit-exact and leave the holder; a source that is
gone, or that lacks a block, is a clean miss; held blocks are freed after their hold time
and past the byte bound, oldest first."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer, probe, pull

BLOCK_BYTES = 3 * 4096 + 5  # not a multiple of anything a buffer might round to


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def block_data(i: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


@pytest.fixture
def served() -> Iterator[tuple[BlockHolder, str]]:
    holder = BlockHolder(1 << 30, 60.0)
    server = BlockServer(holder, "127.0.0.1")
    server.start()
    try:
        yield holder, f"127.0.0.1:{server.port}"
    finally:
        server.stop()


@pytest.mark.parametrize("streams", [1, 3, 8])
def test_blocks_round_trip_bit_exact_over_several_streams_and_leave_the_holder(
        served: tuple[BlockHolder, str], pool: ThreadPoolExecutor, streams: int) -> None:
    holder, address = served
    hashes = [block_hash(i) for i in range(7)]
    for i, h in enumerate(hashes):
        holder.put(h, block_data(i))
    assert holder.held_bytes == 7 * BLOCK_BYTES
    assert probe(address, hashes, 5.0) == 7

    out = torch.zeros((7, BLOCK_BYTES), dtype=torch.uint8)
    assert pull(address, hashes, out, pool, streams, 5.0)
    for i in range(7):
        assert torch.equal(out[i], block_data(i)), f"block {i} differs"
    # Pulled blocks are freed at once: a second pull misses.
    assert holder.held_bytes == 0 and holder.stats.pulled_blocks == 7
    assert probe(address, hashes, 5.0) == 0
    assert not pull(address, hashes, torch.zeros_like(out), pool, streams, 5.0)


def test_a_probe_counts_the_leading_blocks_held_and_a_pull_is_all_or_none(
        served: tuple[BlockHolder, str], pool: ThreadPoolExecutor) -> None:
    holder, address = served
    hashes = [block_hash(i) for i in range(5)]
    for i in (0, 1, 3, 4):  # block 2 missing
        holder.put(hashes[i], block_data(i))
    assert probe(address, hashes, 5.0) == 2
    out = torch.zeros((5, BLOCK_BYTES), dtype=torch.uint8)
    # One stream: the single GET names block 2, so nothing is taken.
    assert not pull(address, hashes, out, pool, 1, 5.0)
    assert holder.held_bytes == 4 * BLOCK_BYTES
    assert pull(address, hashes[:2], out[:2], pool, 2, 5.0)
    assert torch.equal(out[1], block_data(1))


def test_a_source_that_is_gone_is_a_clean_miss(pool: ThreadPoolExecutor) -> None:
    holder = BlockHolder(1 << 20, 60.0)
    server = BlockServer(holder, "127.0.0.1")
    server.start()
    address = f"127.0.0.1:{server.port}"
    holder.put(block_hash(0), block_data(0))
    server.stop()
    out = torch.zeros((1, BLOCK_BYTES), dtype=torch.uint8)
    assert probe(address, [block_hash(0)], 2.0) == 0
    assert not pull(address, [block_hash(0)], out, pool, 4, 2.0)
    assert torch.count_nonzero(out) == 0


def test_a_peer_that_speaks_something_else_is_closed_on(
        served: tuple[BlockHolder, str]) -> None:
    holder, address = served
    holder.put(block_hash(0), block_data(0))
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert conn.recv(16) == b""  # closed without an answer
    assert holder.held_bytes == BLOCK_BYTES


def test_held_blocks_are_freed_after_the_hold_time() -> None:
    clock = Clock()
    holder = BlockHolder(1 << 20, 30.0, clock=clock)
    assert holder.expire() is None
    holder.put(block_hash(0), block_data(0))
    clock.now += 10
    holder.put(block_hash(1), block_data(1))
    assert holder.expire() == pytest.approx(20.0)
    clock.now += 20  # block 0 is due, block 1 has 10 s left
    assert holder.expire() == pytest.approx(10.0)
    assert holder.num_held([block_hash(0)]) == 0
    assert holder.num_held([block_hash(1)]) == 1
    assert holder.held_bytes == BLOCK_BYTES and holder.stats.expired_blocks == 1
    clock.now += 10
    assert holder.take([block_hash(1)]) is None
    assert holder.held_bytes == 0 and holder.stats.expired_blocks == 2
    assert holder.expire() is None


def test_a_block_held_again_falls_due_after_the_later_ones() -> None:
    clock = Clock()
    holder = BlockHolder(1 << 20, 30.0, clock=clock)
    for i in range(3):  # due at 130, 135 and 140 s
        holder.put(block_hash(i), block_data(i))
        clock.now += 5
    holder.put(block_hash(0), block_data(0))  # held again at 115 s: due at 145 s
    assert holder.expire() == pytest.approx(20.0)  # block 1, now the oldest
    clock.now = 141.0  # blocks 1 and 2 are due, block 0 is not
    assert holder.expire() == pytest.approx(4.0)
    assert holder.num_held([block_hash(0)]) == 1
    assert holder.num_held([block_hash(1)]) == holder.num_held([block_hash(2)]) == 0
    assert holder.stats.expired_blocks == 2 and holder.held_bytes == BLOCK_BYTES


def test_the_holder_keeps_within_its_byte_bound_dropping_the_oldest() -> None:
    holder = BlockHolder(3 * BLOCK_BYTES, 60.0)
    for i in range(5):
        holder.put(block_hash(i), block_data(i))
        assert holder.held_bytes <= 3 * BLOCK_BYTES
    assert holder.num_held([block_hash(0)]) == 0 and holder.num_held([block_hash(1)]) == 0
    assert holder.num_held([block_hash(i) for i in (2, 3, 4)]) == 3
    assert holder.stats.expired_blocks == 2
    # Holding a block again replaces it (counted once).
    holder.put(block_hash(4), block_data(4))
    assert holder.held_bytes == 3 * BLOCK_BYTES
    taken = holder.take([block_hash(4)])
    assert taken is not None and torch.equal(taken[0], block_data(4))
