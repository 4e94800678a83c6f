"""The prompt's KV pushed into the decode worker's pool layer by layer (--kv-handoff-push).

With `--kv-handoff ipc --kv-handoff-push` a decode worker keeps a `SlotPool` of its own
(tier/slot_pool.py), served by its block listener (WorkerInfo.kv_handoff_address); the
router names that listener to the prefill worker with the request
(GenerateRequest.kv_target). Then:

1. As the prefill worker's engine takes the request, a thread of the transfer maps that pool
   and RESERVEs a slot for each full prompt block; the scheduler's gate (`pending`, through
   the KV tier's `holds_back`) keeps the request waiting until the answer, as a store probe
   does. The blocks this worker already had cached are copied into their slots once granted.
2. In each step that completes some of its blocks, the model runner calls `layer_written(i)`
   as soon as layer i's kernels are queued. Every few layers (`PUSHES_PER_STEP` runs a step)
   the run's K and V rows of those blocks are copied into the slots on a stream of their
   own, after an event on the compute stream: the copy runs while the later layers compute,
   GPU to GPU over NVLink (on a CPU, at once, into shared memory). The next step's kernels
   wait for these copies (`fence`), since the blocks may be reused once the request ends.
3. Sending COMMITs the written blocks (a request that ends unsent RELEASEs its slots, once
   the copies queued into them are done): the decode worker's listener moves them into its
   holder, where its own probe finds them (RequestDone.kv_source names its listener and the
   reservation, `push_source`); its load is then a copy inside its own GPU.

A reservation's blocks are held under keys of its own (`push_keys`: the block hash hashed with
the reservation's random id), so two reservations of one prompt never share a slot, and a
slot becomes visible only when its writer commits it. The decode worker gives back a slot
never committed after `RESERVE_S` (the prefill worker died, the request was aborted); the
prefill worker writes into a reservation only for `WRITE_S` after it was granted, well within
that. A decode worker without free slots, or a pool that cannot be mapped, is not pushed to:
the prefill worker holds the blocks itself, as without a target.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from meshserve.services.worker.engine.kv_copy import KVCaches, block_index, shared_storage
from meshserve.services.worker.tier.slot_pool import MappedPool, SlotPool
from meshserve.shared.block_hash import BlockHash

if TYPE_CHECKING:
    from meshserve.services.worker.tier.kv_tier import KVTier

# A step's pushes are queued in this many runs of layers, each as soon as its last layer's
# kernels are: a run's copies overlap the later layers' compute. One per layer cost the
# engine thread about 0.3 ms each (Llama-3.1-8B, 32 layers: 10 ms a step, its steps 6%
# longer on the GPU sweep, loadtest/reports/disagg/README.md).
PUSHES_PER_STEP = 4
RESERVE_S = 120.0
WRITE_S = 60.0
# Longest wait for a decode worker's pool handle or reservation (one host, a few bytes): one
# that does not answer in time (stopped, overloaded) is not pushed to, and the transfer
# thread, which also serves the other requests, is not held up longer.
RESERVE_TIMEOUT_S = 1.0
_UNASKED = object()  # a request whose reservation is not asked for yet
_ASKING = object()  # one whose reservation is under way


def push_keys(hashes: Sequence[BlockHash], rid: bytes) -> list[bytes]:
    """The keys a reservation `rid` holds its blocks under at the decode worker."""
    return [hashlib.blake2b(block_hash, key=rid, digest_size=32).digest()
            for block_hash in hashes]


def push_source(target: str, rid: bytes) -> str:
    """RequestDone.kv_source of pushed blocks: the decode worker's listener, then `#` and
    the reservation's id."""
    return f"{target}#{rid.hex()}"


def parse_source(source: str, hashes: Sequence[BlockHash]) -> tuple[str, list[bytes]]:
    """A kv_source's listener, and the keys it holds `hashes` under there (the hashes
    themselves, or a reservation's keys)."""
    address, _, rid = source.partition("#")
    return address, push_keys(hashes, bytes.fromhex(rid)) if rid else list(hashes)


class PendingSlots:
    """Decode side: slots of the pool reserved for pushes and not yet committed, by key;
    committed ones go to the holder (`put`). Thread-safe (the listener's threads)."""

    def __init__(self, pool: SlotPool, put: Callable[[bytes, torch.Tensor], None],
                 evict_oldest: Callable[[], bool], *, reserve_s: float = RESERVE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self._put = put
        self._evict_oldest = evict_oldest
        self.reserve_s = reserve_s
        self._clock = clock
        # Oldest first, so in the order they fall due (one reserve_s).
        self._pending: collections.OrderedDict[bytes, tuple[torch.Tensor, float]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def reserve(self, keys: Sequence[bytes]) -> list[int] | None:
        """A slot for each key (all or none; held blocks not yet taken give theirs up), or
        None when the pool has too few or a key is already reserved."""
        with self._lock:
            self._expire()
            if any(key in self._pending for key in keys):
                return None
            slots: list[torch.Tensor] = []
            for _ in keys:
                slot = self.pool.allocate()
                while slot is None and self._evict_oldest():
                    slot = self.pool.allocate()
                if slot is None:
                    for taken in slots:
                        self.pool.release(taken)
                    return None
                slots.append(slot)
            due = self._clock() + self.reserve_s
            for key, slot in zip(keys, slots, strict=True):
                self._pending[key] = (slot, due)
            return [self.pool.index(slot) for slot in slots]

    def commit(self, keys: Sequence[bytes], *, written: bool = True) -> int:
        """Hold the written slots of `keys` (not `written`: give them back); how many were
        still reserved."""
        with self._lock:
            self._expire()
            taken = [(key, self._pending.pop(key)[0]) for key in keys if key in self._pending]
        for key, slot in taken:
            if written:
                self._put(key, slot)
            else:
                self.pool.release(slot)
        return len(taken)

    def _expire(self) -> None:
        now = self._clock()
        while self._pending:
            key, (slot, due) = next(iter(self._pending.items()))
            if due > now:
                return
            del self._pending[key]
            self.pool.release(slot)


@dataclass
class PushReservation:
    """Prefill side: slots of a decode worker's pool granted for one request's blocks."""

    target: str
    rid: bytes
    mapped: MappedPool
    slots: dict[BlockHash, int]
    granted_at: float
    written: list[BlockHash] = field(default_factory=list)
    local_pushed: bool = False


@dataclass
class _Group:
    """One step's blocks bound for one reservation."""

    reservation: PushReservation
    hashes: list[BlockHash]
    src: torch.Tensor  # cache block ids, on the device
    slots: torch.Tensor  # the target pool's slots, on the device
    dst: torch.Tensor  # the target pool as [slots, layers, words of a layer's K and V]
    next_layer: int = 0  # the first layer not yet pushed


@dataclass
class PushStats:
    pushed_blocks: int = 0
    """Blocks written into a decode worker's pool (all layers) and committed or not."""
    refused_reservations: int = 0
    """Requests whose decode worker granted no slots (the blocks were held here)."""


class LayerPusher:
    """Prefill side: the pushes of the requests that name a decode worker's listener (see
    the module doc). `reserve(request_id, target, hashes)` queues a reservation on a thread
    that answers with `granted`; `release(reservation)` queues giving back the slots of a
    request that ended unsent (once the copies queued so far are done: none are queued into
    them after it is called); `new_blocks` peeks at the blocks the step being launched
    indexes (the block pool's). A step's layers are pushed in runs of `layers_per_push`
    (0: `PUSHES_PER_STEP` runs)."""

    def __init__(self, kv_caches: KVCaches,
                 reserve: Callable[[str, str, list[BlockHash]], None],
                 release: Callable[[PushReservation], None], *,
                 layers_per_push: int = 0, write_s: float = WRITE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device
        self.num_layers = len(kv_caches)
        self.layers_per_push = layers_per_push or -(-self.num_layers // PUSHES_PER_STEP)
        # [layers, 2, blocks, ...]: a layer's K and V rows move in one gather and one copy.
        storage = shared_storage(kv_caches)
        assert storage is not None, "the model runner's caches are views of one tensor"
        self.storage = storage
        self._reserve = reserve
        self._release = release
        self.write_s = write_s
        self._clock = clock
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.new_blocks: Callable[[], list[tuple[int, BlockHash, BlockHash | None]]] = list
        self.stats = PushStats()
        self._targets: dict[str, str] = {}  # request id -> the decode worker's listener
        self._state: dict[str, object] = {}  # request id -> _ASKING, a PushReservation or None
        self._by_hash: dict[BlockHash, PushReservation] = {}
        self._pushed: set[BlockHash] = set()  # written, not held here
        self._plan: list[_Group] = []
        self._outstanding = False
        self._closing: list[PushReservation] = []  # ended unsent mid-launch: released next
        self._lock = threading.Lock()

    def attach(self, watch_layers: Callable[[Callable[[int], None]], None],
               tier: KVTier) -> None:
        """Push from the engine's steps: its layers (`watch_layers`: LLMEngine's), the
        tier's admission gate and the block pool's newly indexed blocks (before the engine
        starts)."""
        watch_layers(self.layer_written)
        tier.push = self
        self.new_blocks = tier.kv.pool.peek_new_cached

    # ----- requests (the worker's event loop and the engine thread) ---------------------
    def target(self, request_id: str, address: str) -> None:
        """Request `request_id`'s blocks go to the listener at `address`."""
        self._targets[request_id] = address

    def forget(self, request_id: str) -> None:
        """The request ended: an unsent reservation's slots are given back (after the step
        being launched, when that step writes into them: `fence`)."""
        found = self.take(request_id)
        if found is None:
            return
        with self._lock:
            if any(group.reservation is found for group in self._plan):
                self._closing.append(found)
                return
        self._release(found)

    def take(self, request_id: str) -> PushReservation | None:
        """The request is sent: its reservation, no longer written to."""
        self._targets.pop(request_id, None)
        with self._lock:
            found = self._state.pop(request_id, None)
            if not isinstance(found, PushReservation):
                return None
            for block_hash in found.slots:
                if self._by_hash.get(block_hash) is found:
                    del self._by_hash[block_hash]
            self._pushed.difference_update(found.written)
            return found

    def pushed(self, block_hash: BlockHash) -> bool:
        """Whether the block went to a decode worker's pool (not to be held here)."""
        return block_hash in self._pushed

    def granted(self, request_id: str, reservation: PushReservation | None) -> None:
        """The answer to `reserve` (None: no slots, or no pool); a reservation of a request
        forgotten meanwhile is given back."""
        with self._lock:
            forgotten = self._state.get(request_id) is not _ASKING
            if not forgotten:
                self._state[request_id] = reservation
        if forgotten:
            if reservation is not None:
                self._release(reservation)
            return
        with self._lock:
            if reservation is None:
                self.stats.refused_reservations += 1
                return
            for block_hash in reservation.slots:
                self._by_hash[block_hash] = reservation

    @property
    def asking(self) -> bool:
        """Whether a reservation is under way."""
        with self._lock:
            return _ASKING in self._state.values()

    def ask(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """Start the reservation of a request that names a decode worker (once)."""
        self._ask(request_id, hashes)

    def _ask(self, request_id: str, hashes: Sequence[BlockHash]) -> tuple[str | None, object]:
        """The request (None: it names no decode worker) and its state before the call."""
        request = request_of(request_id, self._targets)
        if request is None:
            return None, None
        with self._lock:
            state = self._state.get(request, _UNASKED)
            if state is _UNASKED:
                self._state[request] = _ASKING
        if state is _UNASKED:
            self._reserve(request, self._targets[request], list(hashes))
        return request, state

    def pending(self, request_id: str, hashes: Sequence[BlockHash],
                local_blocks: Callable[[], list[int]]) -> bool:
        """Whether the request waits for its reservation (asked for here if not yet);
        once granted, its blocks already cached (`local_blocks`: their ids) are pushed."""
        request, state = self._ask(request_id, hashes)
        if request is None:
            return False
        if state is _UNASKED:
            return True
        if isinstance(state, PushReservation) and not state.local_pushed:
            state.local_pushed = True
            ids = local_blocks()
            self._push_whole(state, list(hashes[:len(ids)]), ids)
        return state is _ASKING

    # ----- the steps (the engine thread) ----------------------------------------------
    def fence(self) -> None:
        """Queue the next step after the pushes queued so far (their blocks may be reused);
        release the reservations of requests that ended unsent, after those pushes."""
        if self._outstanding and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._outstanding = False
        if self._closing:
            with self._lock:
                closing, self._closing = self._closing, []
            for reservation in closing:
                self._release(reservation)

    def layer_written(self, index: int) -> None:
        """The step's kernels of layer `index` are queued: when it ends a run of layers,
        push that run's rows of the step's blocks bound for reservations."""
        if index == 0:
            self._plan_step()
        last = index == self.num_layers - 1
        if not self._plan or ((index + 1) % self.layers_per_push and not last):
            return
        self._copy_layers(self._plan, index + 1)
        if last:
            for group in self._plan:
                self._written(group)
            with self._lock:
                self._plan = []

    def _plan_step(self) -> None:
        """The step's blocks bound for reservations, grouped by reservation (`_plan`)."""
        if not self._by_hash:
            return
        new = self.new_blocks()
        if not new:
            return
        chosen: dict[int, tuple[PushReservation, list[BlockHash], list[int]]] = {}
        now = self._clock()
        with self._lock:  # set with the reservations it writes: `forget` reads both
            for block_id, block_hash, _ in new:
                reservation = self._by_hash.get(block_hash)
                if reservation is None or now - reservation.granted_at > self.write_s:
                    continue
                _, hashes, ids = chosen.setdefault(id(reservation), (reservation, [], []))
                hashes.append(block_hash)
                ids.append(block_id)
            self._plan = [self._group(reservation, hashes, ids)
                          for reservation, hashes, ids in chosen.values()]

    def _group(self, reservation: PushReservation, hashes: list[BlockHash],
               ids: list[int]) -> _Group:
        data = reservation.mapped.data
        # 8-byte words: a copy of single bytes into another GPU's memory is one link
        # transaction per byte (a slot is a whole number of words, and starts on one).
        dst = data.view(torch.int64).view(data.shape[0], self.num_layers, -1)
        src = block_index(ids, self.device)
        slots = block_index([reservation.slots[h] for h in hashes], self.device)
        if self.stream is not None:  # made on the compute stream, read on ours
            src.record_stream(self.stream)
            slots.record_stream(self.stream)
        return _Group(reservation, hashes, src, slots, dst)

    def _push_whole(self, reservation: PushReservation, hashes: list[BlockHash],
                    ids: list[int]) -> None:
        """Push cached blocks, every layer at once."""
        keep = [(h, i) for h, i in zip(hashes, ids, strict=True) if h in reservation.slots]
        if not keep:
            return
        group = self._group(reservation, [h for h, _ in keep], [i for _, i in keep])
        self._copy_layers([group], self.num_layers)
        self._written(group)

    def _copy_layers(self, groups: list[_Group], end: int) -> None:
        """Copy each group's layers up to `end` into their slots: on the push stream after
        the compute stream's work queued so far (on a CPU, now)."""
        if self.stream is None:
            for group in groups:
                self._copy_run(group, end)
            return
        event = torch.cuda.Event()
        event.record()
        self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            for group in groups:
                self._copy_run(group, end)
        self._outstanding = True

    def _copy_run(self, group: _Group, end: int) -> None:
        """Layers [group.next_layer, end) of the group's blocks: one gather, one copy."""
        start, n = group.next_layer, group.src.numel()
        layers = self.storage[start:end]  # [layers, 2, blocks, block_size, heads, head_dim]
        layers = layers.view(torch.uint8) if layers.element_size() == 1 else layers
        rows = layers.index_select(2, group.src).view(end - start, 2, n, -1)
        # [n, layers, K then V]: each slot's run of layers is one run of words there.
        rows = rows.permute(2, 0, 1, 3).contiguous().view(n, -1)
        group.dst[:, start:end].flatten(1).index_copy_(0, group.slots, rows.view(torch.int64))
        group.next_layer = end

    def _written(self, group: _Group) -> None:
        with self._lock:
            group.reservation.written.extend(group.hashes)
            self._pushed.update(group.hashes)
        self.stats.pushed_blocks += len(group.hashes)



def request_of(sequence_id: str, requests: dict[str, str]) -> str | None:
    """The request among `requests` a sequence belongs to: its own id, or for a sibling of
    n > 1 the id before `#index` (the engine's naming)."""
    if sequence_id in requests:
        return sequence_id
    request_id = sequence_id.rpartition("#")[0]
    return request_id if request_id in requests else None
