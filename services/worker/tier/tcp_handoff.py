"""The KV handoff over TCP (--kv-handoff tcp): prefill worker to decode worker, no store between.

`TcpTransfer` is the engine's KV-tier transport (tier/kv_tier.py's KVTransport) with a
thread of its own, wrapped around the kvstore's transfer when the worker has one:

- On a prefill worker, every block the engine indexes (the write-through saves, queued
  right after the step that computes them) is copied by this thread, off the engine
  thread, out of the gathered tensor into host memory of its own and held in a
  `BlockHolder` (tier/tcp_blocks.py), served by the worker's `BlockServer`. A held block is
  freed once pulled or after `hold_s`, and the holder never keeps more than its byte bound.
- On a decode worker, a handed-off request's blocks wait at the source its GenerateRequest
  names (`expect`). The engine probes for the prompt blocks past its own prefix hits as
  for the store: the probe asks the source how many it holds; the engine allocates that
  many blocks; the load pulls them over `streams` parallel connections into one host
  buffer and scatters it into those blocks. A source that is gone, a pull that fails or
  times out: the load fails and the engine recomputes the prompt (nothing else is lost).

With `--kv-handoff ipc` the prefill worker's held blocks are slots of a `SlotPool`
(tier/slot_pool.py: its GPU's memory, or shared memory on a CPU), copied there on the
transfer thread's own stream. A decode worker maps a source's pool once (its handle comes
from the listener), leases the blocks' slots and gathers them on its own device straight
from the pool, over NVLink between GPUs, `_LEASE_CHUNK` blocks at a time, into the blocks
it allocated; a pool it cannot map (another host) is pulled from over TCP as before.
A request that names a decode worker's listener (GenerateRequest.kv_target) skips the
holding: its blocks are pushed into that worker's own pool layer by layer as they are
computed (`LayerPusher`, tier/kv_push.py), and the decode worker's probe and load then find
them at its own listener, copied from its own pool.

Every other probe and load goes to the kvstore's transfer (or finds nothing without one).
`TcpHandoff` (tier/handoff.py) is the `KvHandoff` over it: sending waits until the thread
holds the request's blocks, and names the listener's address as their source.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import torch

from meshserve.services.worker.engine.device import make_current
from meshserve.services.worker.engine.kv_copy import KVCaches, block_shape, scatter_blocks
from meshserve.services.worker.tier.kv_push import (
    RESERVE_TIMEOUT_S,
    LayerPusher,
    PushReservation,
    parse_source,
    push_keys,
    push_source,
    request_of,
)
from meshserve.services.worker.tier.kv_tier import (
    KVTransport,
    LoadDone,
    LoadJob,
    ProbeDone,
    ProbeJob,
    SaveJob,
    TransferDone,
    TransferJob,
)
from meshserve.services.worker.tier.slot_pool import MappedPool, SlotPool, map_pool
from meshserve.services.worker.tier.tcp_blocks import (
    BlockHolder,
    commit,
    lease,
    pool_handle,
    probe,
    pull,
    reserve,
)
from meshserve.shared.block_hash import BlockHash

log = logging.getLogger(__name__)

_STOP = object()
# Blocks gathered from a mapped pool per copy (the 8B shape: 128 MiB of staging memory).
_LEASE_CHUNK = 64
_RECEIVED_POLL_S = 1.0


@dataclass(frozen=True)
class TcpLease:
    """What a probe found: the leading `hashes` that `source` holds."""

    source: str
    hashes: list[BlockHash]


@dataclass(frozen=True)
class _SourcedProbe:
    job: ProbeJob
    source: str


@dataclass
class PullStats:
    """Counters since start (the decode worker's metrics)."""

    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    failed_pulls: int = 0
    mapped_blocks: int = 0
    """Blocks copied straight from a source's mapped pool (the rest came over TCP)."""
    dropped_store_saves: int = 0
    """Prefill side: blocks held for the handoff but not written to a kvstore that fell
    more than `store_backlog_bytes` behind."""


class TcpTransfer:
    """The KV tier's transport with the TCP handoff (see the module doc)."""

    def __init__(self, kv_caches: KVCaches, *, inner: KVTransport | None = None,
                 holder: BlockHolder | None = None, pool: SlotPool | None = None,
                 streams: int = 4, timeout_s: float = 10.0,
                 store_backlog_bytes: int = 1 << 30, push: bool = False) -> None:
        """`pool`: a prefill worker's held blocks' slots, or the pool a decode worker takes
        pushes into (its listener's, `own_address`); `push`: write the blocks of requests
        that name a decode worker's listener into its pool (`pusher`)."""
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device
        self.block_shape = block_shape(kv_caches)
        self.block_bytes = math.prod(self.block_shape) * kv_caches[0][0].element_size()
        self.streams = streams
        self.timeout_s = timeout_s
        self.store_backlog_bytes = store_backlog_bytes
        self.holder = holder
        self.pool = pool
        if pool is not None:
            pool.carve(self.block_bytes)
        self.stats = PullStats()
        self._maps: dict[str, MappedPool | None] = {}  # source -> its pool, mapped
        self._inner = inner
        self._sources: dict[str, str] = {}  # request id -> where its blocks wait
        self._jobs: collections.deque[object] = collections.deque()
        self._wake = threading.Condition()
        self._backlog = 0
        self._queued_saves = self._saves_done = 0  # saves queued and done, in order
        self._saving: dict[str, int] = {}  # sequence id -> its last save not yet done
        self._done: list[TransferDone] = []
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(streams, thread_name_prefix="kv-pull")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="kv-handoff", daemon=True)
        self.own_address = ""
        """A decode worker's listener: a source there is this worker's own pool."""
        self.received: BlockHolder | None = None
        """A decode worker's blocks pushed into its pool (its listener's holder)."""
        self.pusher = (LayerPusher(kv_caches, self._queue_reserve, self._queue_release)
                       if push else None)
        # Reservations and releases have a thread of their own: behind the saves queued for
        # this thread, each waiting for its step on the device, a reservation held up the
        # request's admission by a step or more.
        self._push_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-push")
        self._maps_lock = threading.RLock()

    # ----- the decode side's requests -------------------------------------------------
    def expect(self, request_id: str, source: str) -> None:
        """The blocks of request `request_id` wait at `source` (host:port)."""
        self._sources[request_id] = source

    def forget(self, request_id: str) -> None:
        self._sources.pop(request_id, None)

    def _source_of(self, sequence_id: str) -> str | None:
        """A probing sequence's source (its request's, kept for its siblings when n > 1)."""
        request_id = request_of(sequence_id, self._sources)
        if request_id == sequence_id:
            return self._sources.pop(request_id, None)
        return self._sources.get(request_id) if request_id is not None else None

    # ----- the engine's side (KVTransport) -------------------------------------------
    @property
    def available(self) -> bool:
        """Whether saves are taken: the store's, or a prefill worker's holder."""
        return self.holder is not None or (self._inner is not None and self._inner.available)

    def may_hold(self, request_id: str) -> bool:
        if self._sources and request_of(request_id, self._sources) is not None:
            return True
        return self._inner is not None and self._inner.may_hold(request_id)

    @property
    def save_backlog_bytes(self) -> int:
        """A prefill worker's own backlog (the copies into held memory): a kvstore that
        falls behind drops its own saves (`submit`), never the handoff's."""
        inner = self._inner.save_backlog_bytes if self._inner is not None else 0
        return self._backlog if self.holder is not None else max(inner, self._backlog)

    def submit(self, job: TransferJob) -> None:
        if isinstance(job, SaveJob):
            if self._inner is not None and (
                    self.holder is None
                    or self._inner.save_backlog_bytes + job.nbytes <= self.store_backlog_bytes):
                self._inner.submit(job)
            elif self._inner is not None:
                self.stats.dropped_store_saves += len(job.hashes)
            if self.holder is not None:
                self._queue(job, job.nbytes)
        elif isinstance(job, ProbeJob):
            self._submit_probe(job)
        elif isinstance(job.lease, TcpLease):
            if isinstance(job, LoadJob):  # a DropJob of ours has nothing to release
                self._queue(job)
        elif self._inner is not None:
            self._inner.submit(job)

    def _submit_probe(self, job: ProbeJob) -> None:
        source = self._source_of(job.request_id)
        if source:
            self._queue(_SourcedProbe(job, source))
        elif self._inner is not None:
            self._inner.submit(job)
        else:
            self._finish(ProbeDone(job.request_id, 0, None))

    def take_done(self) -> list[TransferDone]:
        done = self._inner.take_done() if self._inner is not None else []
        if self._done:
            with self._cond:
                done, self._done = [*done, *self._done], []
        return done

    def wait(self, timeout_s: float) -> None:
        asking = self.pusher is not None and self.pusher.asking
        if self._inner is not None and not self._jobs and not asking:
            self._inner.wait(timeout_s)
            return
        with self._cond:
            if not self._done:
                self._cond.wait(timeout_s)

    # ----- the prefill side's pushes ----------------------------------------------------
    def _queue_reserve(self, request_id: str, target: str, hashes: list[BlockHash]) -> None:
        self._push_thread.submit(self._logged, self._reserve, request_id, target, hashes)

    def _queue_release(self, reservation: PushReservation) -> None:
        self._push_thread.submit(self._logged, self._release, reservation)

    def _logged(self, job: Callable[..., None], *args: object) -> None:
        make_current(self.device)
        try:
            job(*args)
        except Exception:  # a bug here must not stop later pushes: the prompt is held
            log.exception("KV push job failed")

    def _release(self, reservation: PushReservation) -> None:
        """Give back a reservation's slots once the copies queued into them are done."""
        assert self.pusher is not None, "only a pushing worker releases"
        if self.pusher.stream is not None:
            self.pusher.stream.synchronize()
        commit(reservation.target, push_keys(list(reservation.slots), reservation.rid),
               self.timeout_s, written=False)

    def _reserve(self, request_id: str, target: str, hashes: list[BlockHash]) -> None:
        """Map the target's pool and reserve its slots for the request's blocks."""
        assert self.pusher is not None, "only a pushing worker reserves"
        granted: PushReservation | None = None
        try:
            mapped = self._mapped(target, RESERVE_TIMEOUT_S)
            if mapped is not None and mapped.data.shape[1] == self.block_bytes:
                rid = secrets.token_bytes(8)
                answer = reserve(target, push_keys(hashes, rid), RESERVE_TIMEOUT_S)
                if answer is not None and answer[0] != mapped.token:
                    self._unmap(target)  # it restarted: its slots there expire
                elif answer is not None:
                    granted = PushReservation(target, rid, mapped,
                                              dict(zip(hashes, answer[1], strict=True)),
                                              time.monotonic())
        finally:
            self.pusher.granted(request_id, granted)
            with self._cond:  # an engine waiting for it (`wait`) goes on at once
                self._cond.notify_all()

    def commit(self, request_id: str) -> str:
        """After a request's steps: tell its decode worker which blocks were pushed; the
        kv_source naming them there ("": none were, or it is gone)."""
        reservation = self.pusher.take(request_id) if self.pusher is not None else None
        if reservation is None or not reservation.written:
            return ""
        assert self.pusher is not None
        if self.pusher.stream is not None:
            self.pusher.stream.synchronize()  # every layer's copy landed
        keys = push_keys(reservation.written, reservation.rid)
        if not commit(reservation.target, keys, self.timeout_s):
            return ""
        return push_source(reservation.target, reservation.rid)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every job queued so far is done (the held blocks are held, the
        reservations asked for answered)."""
        done = threading.Event()
        self._queue(done.set)
        asked = self._push_thread.submit(lambda: None)
        return done.wait(timeout_s) and not futures_wait([asked], timeout_s).not_done

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue(_STOP)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._push_thread.shutdown(wait=True, cancel_futures=True)
        for mapped in self._maps.values():
            if mapped is not None:
                mapped.close()
        self._maps.clear()
        if self.pool is not None and not self._thread.is_alive():
            self.pool.close()

    # ----- the thread ------------------------------------------------------------------
    def _queue(self, job: object, nbytes: int = 0) -> None:
        with self._wake:
            self._backlog += nbytes
            self._jobs.append(job)
            if isinstance(job, SaveJob):
                self._queued_saves += 1
                for owner in job.owners:
                    self._saving[owner] = self._queued_saves
            self._wake.notify_all()  # the thread, and not only a `flush_request` waiting

    def flush_request(self, request_id: str, timeout_s: float) -> bool:
        """Wait until the saves holding the request's blocks are done (not those queued
        after them: each waits for its step on the device, and a prefill worker's next step
        may be a long prompt's)."""
        with self._wake:
            # Its sequences: the request's own id, or `id#index` for its siblings of n > 1.
            due = max((seq for owner, seq in self._saving.items()
                       if request_id in (owner, owner.rpartition("#")[0])), default=0)
            return self._wake.wait_for(lambda: self._saves_done >= due, timeout_s)

    def _run(self) -> None:
        make_current(self.device)
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait(self._next_expiry())
                job = self._jobs.popleft()
            if job is _STOP:
                return
            self._do(job)

    def _next_expiry(self) -> float | None:
        """Free held blocks past their time; how long until the next one is due. Blocks
        pushed to a decode worker are put by its listener's threads: it looks again within
        `_RECEIVED_POLL_S`."""
        if self.holder is not None:
            return self.holder.expire()
        if self.received is not None:
            due = self.received.expire()
            return _RECEIVED_POLL_S if due is None else min(due, _RECEIVED_POLL_S)
        return None

    def _do(self, job: object) -> None:
        try:
            if isinstance(job, SaveJob):
                self._hold(job)
            elif isinstance(job, _SourcedProbe):
                self._probe(job)
            elif isinstance(job, LoadJob):
                self._load(job)
            else:
                job()  # type: ignore[operator]
        except Exception:  # a bug here must not kill the worker: the prompt is recomputed
            log.exception("KV handoff job failed")
        finally:
            if isinstance(job, SaveJob):
                with self._wake:
                    self._backlog -= job.nbytes
                    self._saves_done += 1
                    for owner in job.owners:
                        if self._saving.get(owner) == self._saves_done:
                            del self._saving[owner]
                    self._wake.notify_all()

    def _hold(self, job: SaveJob) -> None:
        """Copy each block into memory of its own and hold it (prefill side): host memory,
        or a slot of the pool."""
        assert self.holder is not None, "only a prefill worker holds blocks"
        if job.ready is not None:
            job.ready.synchronize()
        rows = job.data.reshape(len(job.hashes), -1).view(torch.uint8)  # [n, block bytes]
        hashes = job.hashes
        if self.pusher is not None:  # blocks pushed to a decode worker are held there
            kept = [i for i, h in enumerate(hashes) if not self.pusher.pushed(h)]
            if len(kept) < len(hashes):
                hashes, rows = [hashes[i] for i in kept], rows[kept]
        if self.pool is not None:
            self._hold_in_pool(hashes, rows)
            return
        for block_hash, row in zip(hashes, rows, strict=True):
            data = torch.empty(row.numel(), dtype=torch.uint8)
            data.copy_(row)
            self.holder.put(block_hash, data)

    def _hold_in_pool(self, hashes: list[BlockHash], rows: torch.Tensor) -> None:
        """Copy blocks into free slots (the oldest held blocks give theirs up), then hold
        them once the copies are done; a block finding no slot (all lent) is not held."""
        assert self.pool is not None and self.holder is not None
        slots: list[torch.Tensor] = []
        for _ in hashes:
            slot = self.pool.allocate()
            while slot is None and self.holder.evict_oldest():
                slot = self.pool.allocate()
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            return
        # One copy for the step's blocks, in 8-byte words (a copy per block cost the
        # transfer thread, and the interpreter lock the engine thread needs, ~10 us each).
        index = torch.tensor([self.pool.index(slot) for slot in slots], dtype=torch.long)
        with self._on_stream():
            self.pool.data.view(torch.int64).index_copy_(
                0, index.to(self.device, non_blocking=True),
                rows[:len(slots)].view(torch.int64))
        if self._stream is not None:
            self._stream.synchronize()
        for block_hash, slot in zip(hashes, slots, strict=False):
            self.holder.put(block_hash, slot)

    def _probe(self, probed: _SourcedProbe) -> None:
        job, found = probed.job, 0
        address, keys = parse_source(probed.source, job.hashes)
        own = self.received if address == self.own_address else None
        if own is not None and job.cached:
            # Pushed copies of blocks this worker has cached: their slots are free at once.
            own.drop(parse_source(probed.source, job.cached)[1])
        try:  # blocks pushed here are looked up in the holder, not over its own socket
            found = own.num_held(keys) if own is not None else probe(address, keys,
                                                                     self.timeout_s)
        finally:
            if not found:  # the source is gone, or no longer holds them: a failed pull too
                self.stats.failed_pulls += 1
                self._unmap(address)
            lease = TcpLease(probed.source, job.hashes[:found]) if found else None
            self._finish(ProbeDone(job.request_id, found, lease))

    def _load(self, job: LoadJob) -> None:
        ok = False
        try:
            ok = self._pull_into_cache(job)
        finally:
            if not ok:
                self.stats.failed_pulls += 1
            self._finish(LoadDone(job.request_id, ok))

    def _pull_into_cache(self, job: LoadJob) -> bool:
        lease_: TcpLease = job.lease  # type: ignore[assignment]
        started = time.perf_counter()
        address, keys = parse_source(lease_.source, lease_.hashes[:len(job.block_ids)])
        mapped = self._mapped(address)
        if mapped is not None:
            ok = self._copy_from_pool(mapped, address, keys, job)
        else:
            ok = self._pull_over_tcp(address, keys, job)
        if ok:
            n = len(job.block_ids)
            self.stats.pulled_blocks += n
            self.stats.pulled_bytes += n * self.block_bytes
            self.stats.pull_seconds += time.perf_counter() - started
        return ok

    def _pull_over_tcp(self, address: str, keys: list[bytes], job: LoadJob) -> bool:
        n = len(job.block_ids)
        dtype = self.kv_caches[0][0].dtype
        # [n, layers, 2, block_size, kv_heads, head_dim], page-locked on a GPU host
        packed = torch.empty((n, *self.block_shape), dtype=dtype,
                             pin_memory=self._stream is not None)
        if not pull(address, keys, packed.view(n, -1).view(torch.uint8),
                    self._pool, self.streams, self.timeout_s):
            return False
        if self._stream is None:
            scatter_blocks(self.kv_caches, job.block_ids, packed)
        else:
            with torch.cuda.stream(self._stream):
                if job.after is not None:
                    self._stream.wait_event(job.after)
                scatter_blocks(self.kv_caches, job.block_ids,
                               packed.to(self.device, non_blocking=True))
            self._stream.synchronize()
        return True

    def _mapped(self, source: str, timeout_s: float | None = None) -> MappedPool | None:
        """The source's pool mapped here (once per source); None: pull over TCP. This
        worker's own listener's is its own pool."""
        with self._maps_lock:
            if source not in self._maps and source == self.own_address and self.pool:
                self._maps[source] = MappedPool(self.pool.token, self.pool.data)
            if source not in self._maps:
                handle = pool_handle(source, timeout_s or self.timeout_s)
                self._maps[source] = map_pool(handle, self.device) if handle else None
            return self._maps[source]

    @property
    def mapped_sources(self) -> list[str]:
        """The sources whose pools this worker maps now."""
        return [source for source, mapped in self._maps.items() if mapped is not None]

    def _unmap(self, source: str) -> None:
        """Let go of a source's pool after a miss (mapped again when next asked): a mapping
        of a source that died or restarted would only hold memory that is no longer
        served."""
        with self._maps_lock:
            mapped = self._maps.pop(source, None)
        if mapped is not None:
            mapped.close()

    def _copy_from_pool(self, mapped: MappedPool, address: str, keys: list[bytes],
                        job: LoadJob) -> bool:
        """Lease the blocks' slots and gather them from the mapped pool into the cache."""
        n = len(job.block_ids)
        if address == self.own_address and self.received is not None:
            return self._copy_received(keys, job)
        slots = lease(address, keys, self.timeout_s)
        if slots is None:
            self._unmap(address)
            return False  # no longer held: recomputed
        try:
            if slots.token != mapped.token:  # the source restarted: map its new pool
                self._unmap(address)
                remapped = self._mapped(address)
                if remapped is None or remapped.token != slots.token:
                    return False
                mapped = remapped
            self._gather(mapped, slots.slots, job)
        finally:
            slots.close()
        self.stats.mapped_blocks += n
        return True

    def _copy_received(self, keys: list[bytes], job: LoadJob) -> bool:
        """Blocks pushed into this worker's own pool: taken from its holder (no lease
        over the socket), gathered into the cache, their slots freed."""
        assert self.received is not None and self.pool is not None
        blocks = self.received.take(keys)
        if blocks is None:
            return False  # expired meanwhile: recomputed
        try:
            own = self._maps[self.own_address]
            assert own is not None
            self._gather(own, [self.pool.index(block) for block in blocks], job)
        finally:
            self.received.give_back(blocks)
        self.stats.mapped_blocks += len(blocks)
        return True

    def _gather(self, mapped: MappedPool, slots: list[int], job: LoadJob) -> None:
        index = torch.tensor(slots, dtype=torch.long).to(self.device)
        dtype = self.kv_caches[0][0].dtype
        with self._on_stream():
            if self._stream is not None and job.after is not None:
                self._stream.wait_event(job.after)
            for start in range(0, len(job.block_ids), _LEASE_CHUNK):
                end = min(start + _LEASE_CHUNK, len(job.block_ids))
                # Read over the link in 8-byte words (a byte at a time is far slower).
                rows = mapped.data.view(torch.int64).index_select(0, index[start:end])
                scatter_blocks(self.kv_caches, job.block_ids[start:end],
                               rows.view(dtype).view(end - start, *self.block_shape))
        if self._stream is not None:
            self._stream.synchronize()  # copied before the lease lets the slots go

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        """The transfer thread's own CUDA stream made current (nothing on a CPU)."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _finish(self, done: TransferDone) -> None:
        with self._cond:
            self._done.append(done)
            self._cond.notify_all()
