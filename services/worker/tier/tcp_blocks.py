"""KV blocks over raw TCP: a prefill worker's held blocks, its listener, a decode worker's pull.

The prefill worker keeps the blocks it handed off in a `BlockHolder` (host memory, by block
hash) and serves them from a `BlockServer`; the decode worker `probe`s how many of a
prompt's blocks are held and `pull`s them over K parallel connections into one buffer it
allocated first (each connection fetches one contiguous run of the blocks).

The wire: a request is a 9-byte header (magic b"MKV1", op, block count) and the 32-byte
block hashes; HAS answers a 4-byte count of the leading hashes held; GET answers a 12-byte
header (block count, bytes per block) and then the blocks' bytes, back to back, nothing
per block. A GET takes its blocks out of the holder (all or none: count 0 is a miss), so a
pulled block is freed at once; a block nobody pulls is freed after `hold_s`, and the holder
never keeps more than `max_bytes` (the oldest blocks go first).

With `--kv-handoff ipc` the held blocks are slots of a `SlotPool` (tier/slot_pool.py) and two
more requests serve a decode worker on the same host: MAP (no hashes) answers a 4-byte
length and the pool's handle, for the decode worker to map the pool once; LEASE answers the
blocks' count (0: a miss), the pool's 8-byte token and their 4-byte slot numbers, then keeps
the slots out of use until the decode worker, having copied them, sends one byte (answered
with one once the slots are free) or closes the connection. GET still serves everyone else, copying each slot out.

A decode worker's listener (--kv-handoff ipc) takes pushes into its own pool
(tier/kv_push.py): RESERVE, with a deadline (the first 32-byte entry: nanoseconds since the
epoch, then zeros; the host's own clock, a pool being mapped only on its host) and the keys of
a prefill worker's reservation, answers as LEASE does (count 0: no room, or read past the
deadline: a writer that gave up waiting must not leave slots reserved) and keeps those slots
for the writer; COMMIT, with the keys written,
answers how many were still reserved and holds them, for the worker's own probe and lease;
RELEASE answers the same count and frees them (the request ended unsent).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from meshserve.services.worker.tier.kv_push import PendingSlots
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.shared.block_hash import BlockHash

MAGIC = b"MKV1"
OP_HAS = 1
OP_GET = 2
OP_MAP = 3
OP_LEASE = 4
OP_RESERVE = 5
OP_COMMIT = 6
OP_RELEASE = 7
HASH_BYTES = 32
_REQUEST = struct.Struct("!4sBI")  # magic, op, number of hashes
_COUNT = struct.Struct("!I")  # HAS: leading hashes held
_BLOCKS = struct.Struct("!IQ")  # GET: blocks sent (0: a miss), bytes per block
_LEASED = struct.Struct("!Iq")  # LEASE: blocks leased (0: a miss), the pool's token
_DEADLINE = struct.Struct("!q")  # RESERVE: the first entry's leading bytes
# Most hashes one request may name (a 128k-token prompt of 16-token blocks is 8k).
_MAX_HASHES = 1 << 16
_MAX_HANDLE = 1 << 16


@dataclass
class HolderStats:
    """Counters since start (the prefill worker's metrics)."""

    held_blocks: int = 0
    pulled_blocks: int = 0
    expired_blocks: int = 0
    """Freed after `hold_s` without a pull, or pushed out by the byte bound."""


class BlockHolder:
    """Blocks waiting to be pulled, by hash: freed when pulled, after `hold_s`, or when
    newer blocks need the room (`max_bytes`). A block dropped unpulled goes to `release`
    (a pool's slot back to it); one taken is the taker's to `give_back`. Thread-safe."""

    def __init__(self, max_bytes: int, hold_s: float, *,
                 clock: Callable[[], float] = time.monotonic,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.hold_s = hold_s
        self._clock = clock
        self._release = release
        self._blocks: collections.OrderedDict[BlockHash, tuple[torch.Tensor, float]] = (
            collections.OrderedDict())  # oldest first: (uint8 bytes, freed at)
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = HolderStats()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def put(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        """Hold one block's bytes (a uint8 tensor of its own, or a pool's slot) for
        `hold_s`."""
        with self._lock:
            if block_hash in self._blocks:
                self._drop(block_hash)
            self._blocks[block_hash] = (data, self._clock() + self.hold_s)
            self._bytes += data.numel()
            self.stats.held_blocks += 1
            self._expire_locked()
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._blocks)))
                self.stats.expired_blocks += 1

    def evict_oldest(self) -> bool:
        """Drop the oldest held block (its slot wanted for a newer one); False: none held."""
        with self._lock:
            if not self._blocks:
                return False
            self._drop(next(iter(self._blocks)))
            self.stats.expired_blocks += 1
            return True

    def give_back(self, blocks: Sequence[torch.Tensor]) -> None:
        """Blocks `take` returned, done with (their slots free again)."""
        if self._release is not None:
            for block in blocks:
                self._release(block)

    def drop(self, hashes: Sequence[BlockHash]) -> int:
        """Free the held blocks of `hashes` (no longer wanted); how many were held."""
        with self._lock:
            held = [h for h in hashes if h in self._blocks]
            for block_hash in held:
                self._drop(block_hash)
            return len(held)

    def num_held(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, are held."""
        with self._lock:
            self._expire_locked()
            count = 0
            for block_hash in hashes:
                if block_hash not in self._blocks:
                    break
                count += 1
            return count

    def take(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor] | None:
        """Remove and return the blocks of `hashes`, or None (nothing removed) when one is
        not held."""
        with self._lock:
            self._expire_locked()
            if not all(h in self._blocks for h in hashes):
                return None
            taken = [self._pop(h) for h in hashes]
            self.stats.pulled_blocks += len(taken)
            return taken

    def expire(self) -> float | None:
        """Free the blocks past their time; seconds until the next one is due (None: none
        held)."""
        with self._lock:
            self._expire_locked()
            if not self._blocks:
                return None
            _, at = next(iter(self._blocks.values()))
            return max(at - self._clock(), 0.0)

    def _expire_locked(self) -> None:
        # Blocks sit in the order they fall due (one hold_s, a clock that only goes
        # forward, a block put again moved to the end): only the oldest are looked at. A
        # scan of every held block on each put made one request's 500 blocks cost the
        # process's other threads tens of ms of the interpreter lock.
        now = self._clock()
        while self._blocks:
            block_hash, (_, at) = next(iter(self._blocks.items()))
            if at > now:
                return
            self._drop(block_hash)
            self.stats.expired_blocks += 1

    def _drop(self, block_hash: BlockHash) -> None:
        data = self._pop(block_hash)
        if self._release is not None and data.numel():
            self._release(data)

    def _pop(self, block_hash: BlockHash) -> torch.Tensor:
        data, _ = self._blocks.pop(block_hash, (None, 0.0))
        if data is None:
            return torch.empty(0, dtype=torch.uint8)
        self._bytes -= data.numel()
        return data


class BlockServer:
    """Serves a holder's blocks on `host:port` (0: any port), a thread per connection;
    with `pool` (the holder's blocks are its slots), MAP, LEASE, RESERVE and COMMIT too."""

    def __init__(self, holder: BlockHolder, host: str, port: int = 0, *,
                 pool: SlotPool | None = None) -> None:
        self.holder = holder
        self.pending = (PendingSlots(pool, holder.put, holder.evict_oldest)
                        if pool is not None else None)
        handler = type("_Handler", (_Handler,), {"holder": holder, "pool": pool,
                                                  "pending": self.pending})
        self._server = socketserver.ThreadingTCPServer((host, port), handler,
                                                       bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kv-handoff-server", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(socketserver.BaseRequestHandler):
    holder: BlockHolder
    pool: SlotPool | None
    pending: PendingSlots | None

    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        magic, op, count = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
        if magic != MAGIC or count > _MAX_HASHES or op not in _OPS:
            return  # not our client: close
        raw = _recv_exact(conn, count * HASH_BYTES)
        hashes = [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
        if op == OP_HAS:
            conn.sendall(_COUNT.pack(self.holder.num_held(hashes)))
        elif op == OP_MAP:
            handle = self.pool.handle() if self.pool is not None else b""
            conn.sendall(_COUNT.pack(len(handle)) + handle)
        elif op == OP_LEASE:
            self._lease(conn, hashes)
        elif op == OP_RESERVE:
            self._reserve(conn, hashes)
        elif op in (OP_COMMIT, OP_RELEASE):
            committed = (self.pending.commit(hashes, written=op == OP_COMMIT)
                         if self.pending is not None else 0)
            conn.sendall(_COUNT.pack(committed))
        else:
            self._get(conn, hashes)

    def _get(self, conn: socket.socket, hashes: list[BlockHash]) -> None:
        blocks = self.holder.take(hashes)
        if not blocks:
            conn.sendall(_BLOCKS.pack(0, 0))
            return
        try:
            conn.sendall(_BLOCKS.pack(len(blocks), blocks[0].numel()))
            for block in blocks:  # a pool's slots on a GPU are copied out one by one
                conn.sendall(block.cpu().numpy().data)
        finally:
            self.holder.give_back(blocks)

    def _lease(self, conn: socket.socket, hashes: list[BlockHash]) -> None:
        """Lend the blocks' slots until the client says it copied them (or goes away)."""
        pool = self.pool
        blocks = self.holder.take(hashes) if pool is not None else None
        if pool is None or not blocks:
            conn.sendall(_LEASED.pack(0, 0))
            return
        try:
            slots = [pool.index(block) for block in blocks]
            conn.sendall(_LEASED.pack(len(slots), pool.token)
                         + struct.pack(f"!{len(slots)}I", *slots))
            conn.settimeout(self.holder.hold_s)
            with contextlib.suppress(OSError):
                conn.recv(1)  # the copy is done, or the client closed or died
        finally:
            self.holder.give_back(blocks)
        with contextlib.suppress(OSError):
            conn.sendall(b"\x01")  # the slots are free again


    def _reserve(self, conn: socket.socket, entries: list[bytes]) -> None:
        """Slots of the pool for a prefill worker to write (all or none), unless read past
        the request's deadline."""
        (deadline,) = _DEADLINE.unpack(entries[0][:_DEADLINE.size]) if entries else (0,)
        keys = entries[1:]
        slots = (self.pending.reserve(keys)
                 if self.pending is not None and keys and time.time_ns() < deadline else None)
        if self.pool is None or not slots:
            conn.sendall(_LEASED.pack(0, 0))
            return
        conn.sendall(_LEASED.pack(len(slots), self.pool.token)
                     + struct.pack(f"!{len(slots)}I", *slots))


_OPS = (OP_HAS, OP_GET, OP_MAP, OP_LEASE, OP_RESERVE, OP_COMMIT, OP_RELEASE)


def probe(address: str, hashes: Sequence[BlockHash], timeout_s: float) -> int:
    """How many of `hashes`, from the first, the source at `address` holds (0 when it
    cannot be reached)."""
    if not hashes:
        return 0
    try:
        with _connect(address, timeout_s) as conn:
            conn.sendall(_request(OP_HAS, hashes))
            (count,) = _COUNT.unpack(_recv_exact(conn, _COUNT.size))
    except OSError:
        return 0
    return min(int(count), len(hashes))


def pull(address: str, hashes: Sequence[BlockHash], out: torch.Tensor,
         pool: ThreadPoolExecutor, streams: int, timeout_s: float) -> bool:
    """Fetch the blocks of `hashes` into `out` (uint8 CPU [n, bytes per block]) over up to
    `streams` connections run on `pool`; False when any part is missing or fails."""
    assert out.dtype == torch.uint8 and out.dim() == 2 and out.shape[0] == len(hashes), \
        f"pull needs a uint8 [n, block bytes] buffer, got {out.dtype} {tuple(out.shape)}"
    runs = _runs(len(hashes), streams)
    futures = [pool.submit(_pull_run, address, hashes[a:b], out[a:b], timeout_s)
               for a, b in runs]
    results = [f.result() for f in futures]  # every run ends before `out` is used
    return all(results)


def _pull_run(address: str, hashes: Sequence[BlockHash], out: torch.Tensor,
              timeout_s: float) -> bool:
    try:
        with _connect(address, timeout_s) as conn:
            conn.sendall(_request(OP_GET, hashes))
            count, size = _BLOCKS.unpack(_recv_exact(conn, _BLOCKS.size))
            if count != len(hashes) or size != out.shape[1]:
                return False
            _recv_into(conn, out.numpy().data.cast("B"))
    except OSError:
        return False
    return True


def pool_handle(address: str, timeout_s: float) -> bytes:
    """The handle of the pool the source at `address` holds its blocks in (b"": none, or
    it cannot be reached)."""
    try:
        with _connect(address, timeout_s) as conn:
            conn.sendall(_request(OP_MAP, []))
            (size,) = _COUNT.unpack(_recv_exact(conn, _COUNT.size))
            return _recv_exact(conn, size) if size <= _MAX_HANDLE else b""
    except OSError:
        return b""


class SlotLease:
    """Slots of a source's pool lent to this process: `slots` (numbers) of the pool whose
    token is `token`, kept out of use there until `close` (after the copy)."""

    def __init__(self, conn: socket.socket, token: int, slots: list[int]) -> None:
        self._conn = conn
        self.token = token
        self.slots = slots

    def close(self) -> None:
        """Say the copy is done; returns once the source took the slots back (or is
        gone)."""
        with contextlib.suppress(OSError):
            self._conn.sendall(b"\x01")
            self._conn.recv(1)
        self._conn.close()


def lease(address: str, hashes: Sequence[BlockHash], timeout_s: float) -> SlotLease | None:
    """Lease the slots holding `hashes` (all or none) from the source at `address`; None
    when it holds them no longer, has no pool or cannot be reached."""
    try:
        conn = _connect(address, timeout_s)
    except OSError:
        return None
    try:
        conn.sendall(_request(OP_LEASE, hashes))
        count, token = _LEASED.unpack(_recv_exact(conn, _LEASED.size))
        if count == len(hashes) and count:
            slots = struct.unpack(f"!{count}I", _recv_exact(conn, 4 * count))
            return SlotLease(conn, token, list(slots))
    except OSError:
        pass
    conn.close()
    return None


def reserve(address: str, keys: Sequence[bytes], timeout_s: float
            ) -> tuple[int, list[int]] | None:
    """Reserve a slot of the pool at `address` for each key: its token and the slots, or
    None (no room, no pool, unreachable)."""
    # Answered by half the wait at the latest: the rest is for the answer to come back.
    deadline = _DEADLINE.pack(time.time_ns() + int(timeout_s * 5e8)).ljust(HASH_BYTES, b"\0")
    try:
        with _connect(address, timeout_s) as conn:
            conn.sendall(_request(OP_RESERVE, [deadline, *keys]))
            count, token = _LEASED.unpack(_recv_exact(conn, _LEASED.size))
            if count != len(keys) or not count:
                return None
            return token, list(struct.unpack(f"!{count}I", _recv_exact(conn, 4 * count)))
    except OSError:
        return None


def commit(address: str, keys: Sequence[bytes], timeout_s: float, *,
           written: bool = True) -> int:
    """Say the reserved slots of `keys` are written (not `written`: no longer wanted); how
    many the listener then holds (or freed)."""
    if not keys:
        return 0
    try:
        with _connect(address, timeout_s) as conn:
            conn.sendall(_request(OP_COMMIT if written else OP_RELEASE, keys))
            (count,) = _COUNT.unpack(_recv_exact(conn, _COUNT.size))
            return int(count)
    except OSError:
        return 0


def _runs(n: int, streams: int) -> list[tuple[int, int]]:
    """`n` blocks cut into at most `streams` contiguous, nearly equal runs."""
    parts = max(1, min(streams, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def _request(op: int, hashes: Sequence[BlockHash]) -> bytes:
    assert all(len(h) == HASH_BYTES for h in hashes), "block hashes are 32 bytes"
    return _REQUEST.pack(MAGIC, op, len(hashes)) + b"".join(hashes)


def _connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _recv_into(conn, memoryview(buffer))
    return bytes(buffer)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError(f"the peer closed after {got} of {len(view)} bytes")
        got += n
