"""The engine's side of the KV tier (the kvstore): save computed blocks, load missing ones.

Saving is write-through: every block the prefix cache indexes (a full block whose KV is
computed, or queued on the device to be) is copied out of the paged cache by one gather on
the device stream right after the step that computes it, and handed to the transfer thread,
which writes it to the store. The engine never waits for a save; when the transfer thread
falls behind by more than `max_save_backlog_bytes`, new saves are dropped (counted).

Loading happens at admission. A waiting request whose full prompt blocks go past the local
prefix hits is probed: the transfer thread asks the store for the following blocks and
leases those it holds. Meanwhile the request waits and the engine runs everything else. With
the answer, the engine takes fresh blocks, the transfer thread copies the leased blocks into
them, and once they are in the cache they are indexed like any computed block and released:
the request's next admission finds them as ordinary prefix hits. A store that is away only
costs recomputation.

A prefill worker that pushes prompts' KV into decode workers' pools (tier/kv_push.py) gives
the tier its `PushGate`: a request that names a decode worker asks for its slots there as
it is added, waits at admission until they are reserved (they are by then, mostly), and
each step is queued after the pushes of the step before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from meshserve.services.worker.engine.hooks import NewRequest, StepHook
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.kv_copy import KVCaches, gather_blocks
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.shared.block_hash import BlockHash

# Longest wait for the store when a step has nothing else to run; new requests arriving
# meanwhile are admitted at the next step, so this bounds their extra wait.
IDLE_WAIT_S = 0.002


@dataclass
class SaveJob:
    """Blocks to write to the store: `data` [n, layers, 2, block_size, kv_heads, head_dim]."""

    hashes: list[BlockHash]
    parents: list[BlockHash]
    data: torch.Tensor
    ready: torch.cuda.Event | None
    """Recorded on the device stream after the gather (None on a CPU)."""
    owners: frozenset[str] = frozenset()
    """The sequences whose blocks these are."""

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class ProbeJob:
    """Ask the store for `hashes` (consecutive prompt blocks); lease the leading ones held."""

    request_id: str
    hashes: list[BlockHash]
    cached: list[BlockHash] = field(default_factory=list)
    """The prompt's blocks before `hashes`, hits in the local cache (a copy of them waiting
    for this worker elsewhere is not needed)."""


@dataclass
class LoadJob:
    """Copy the leased blocks into cache blocks `block_ids`, then release the lease."""

    request_id: str
    lease: object
    block_ids: list[int]
    after: torch.cuda.Event | None
    """The device stream's position when the blocks were handed out: earlier steps may still
    use them, so the copy waits for it (None on a CPU)."""


@dataclass
class DropJob:
    """Release a lease without loading it."""

    lease: object


@dataclass(frozen=True)
class ProbeDone:
    request_id: str
    num_found: int
    lease: object | None


@dataclass(frozen=True)
class LoadDone:
    request_id: str
    ok: bool


TransferJob = SaveJob | ProbeJob | LoadJob | DropJob
TransferDone = ProbeDone | LoadDone


class PushGate(Protocol):
    """A prefill worker's pushes, as the tier sees them (tier/kv_push.py's LayerPusher)."""

    def ask(self, request_id: str, hashes: list[BlockHash]) -> None:
        """Start the request's push reservation, when it names a decode worker."""
        ...

    @property
    def asking(self) -> bool:
        """Whether a reservation is under way."""
        ...

    def pending(self, request_id: str, hashes: list[BlockHash],
                local_blocks: Callable[[], list[int]]) -> bool:
        """Whether the request waits for its push reservation."""
        ...

    def fence(self) -> None:
        """Queue what follows after the pushes queued so far."""
        ...


class KVTransport(Protocol):
    """What the engine needs of the transfer thread."""

    @property
    def available(self) -> bool:
        """Whether the store is reachable now (otherwise nothing is submitted)."""
        ...

    @property
    def save_backlog_bytes(self) -> int:
        """Bytes of submitted saves not yet written."""
        ...

    def may_hold(self, request_id: str) -> bool:
        """Whether a probe for this sequence's prompt blocks may find any (the store is
        reachable, or a handoff source is known for it)."""
        ...

    def submit(self, job: TransferJob) -> None: ...

    def take_done(self) -> list[TransferDone]:
        """Probes and loads finished since the last call (never blocks)."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Until something is done or `timeout_s` passes."""
        ...


@dataclass
class TierStats:
    """Counters since start (read by the worker's metrics)."""

    saved_blocks: int = 0
    dropped_saves: int = 0
    probes: int = 0
    loaded_blocks: int = 0
    failed_loads: int = 0


@dataclass
class _Loading:
    request: SequenceState
    start: int
    """Index of the first loaded block in the request's block hashes."""
    local: list = field(default_factory=list)  # local prefix hits, held during the load
    blocks: list = field(default_factory=list)  # fresh blocks the load fills


class KVTier(StepHook):
    """Saves newly indexed blocks and loads store-held prompt blocks at admission; runs in
    the engine through its step hooks (and the scheduler's admission gate, `holds_back`)."""

    def __init__(self, kv: KVCacheManager, kv_caches: KVCaches, transport: KVTransport, *,
                 max_save_backlog_bytes: int) -> None:
        self.kv = kv
        self.kv_caches = kv_caches
        self.transport = transport
        self.max_save_backlog_bytes = max_save_backlog_bytes
        self.on_cuda = kv_caches[0][0].device.type == "cuda"
        self.stats = TierStats()
        self._probing: dict[str, tuple[SequenceState, int]] = {}  # id -> (request, first block)
        self._loading: dict[str, _Loading] = {}
        self.push: PushGate | None = None
        kv.pool.track_new_cached()

    @property
    def busy(self) -> bool:
        """Whether a probe, a load or a push reservation is under way (an engine with
        nothing else to run then waits for it rather than spinning: a spinning engine
        thread kept the reservation's own thread from the GIL, up to 5 ms at a time)."""
        return bool(self._probing or self._loading) or (self.push is not None
                                                         and self.push.asking)

    def admit(self, sequences: Sequence[SequenceState], request: NewRequest) -> None:
        """Ask for a pushed request's slots now, not when it reaches the queue's head."""
        if self.push is None or not sequences:
            return
        first = sequences[0]  # its siblings share the prompt
        self.kv.update_hashes(first)
        self.push.ask(first.request_id,
                      first.block_hashes[:first.num_tokens // self.kv.block_size])

    # ----- admission (the local scheduler asks) ---------------------------------------
    def holds_back(self, request: SequenceState, num_local_blocks: int) -> bool:
        """Whether `request` waits for the store before admission (a probe or load is on).

        Called with the request's local prefix hits; starts a probe the first time the
        request's prompt has full blocks past them.
        """
        if request.request_id in self._probing or request.request_id in self._loading:
            return True
        if self.push is not None and self.push.pending(
                request.request_id, request.block_hashes[:request.num_tokens // self.kv.block_size],
                lambda: [block.block_id for block in self.kv.get_computed_blocks(request)]):
            return True
        if request.store_checked or request.params.prompt_logprobs is not None:
            return False
        request.store_checked = True
        # As get_computed_blocks: the last token is always computed.
        last = (request.num_tokens - 1) // self.kv.block_size
        if last <= num_local_blocks or not self.transport.may_hold(request.request_id):
            return False
        self._probing[request.request_id] = (request, num_local_blocks)
        self.stats.probes += 1
        self.transport.submit(ProbeJob(request.request_id,
                                       request.block_hashes[num_local_blocks:last],
                                       request.block_hashes[:num_local_blocks]))
        return True

    # ----- every step -------------------------------------------------------------
    def step_begins(self) -> None:
        if self.push is not None:
            self.push.fence()
        self.poll()

    def step_ends(self, idle: bool) -> bool:
        """Queue the step's new blocks for the store; with nothing else to do, wait a
        little for the store instead of spinning."""
        queued = self.save_new_blocks() > 0
        if idle and self.busy:
            self.wait(IDLE_WAIT_S)
        return queued

    def poll(self) -> None:
        """Apply finished probes (start their loads) and loads (index their blocks)."""
        for done in self.transport.take_done():
            if isinstance(done, ProbeDone):
                self._probed(done)
            else:
                self._loaded(done)

    def save_new_blocks(self) -> int:
        """Queue the blocks indexed since the last call for the store (after the step that
        computes them is queued on the device); how many were queued."""
        new = self.kv.pool.take_new_cached()
        owners = frozenset(self.kv.pool.take_new_owners())
        if not new or not self.transport.available:
            return 0
        per_block = self._block_bytes()
        if self.transport.save_backlog_bytes + per_block * len(new) > self.max_save_backlog_bytes:
            self.stats.dropped_saves += len(new)
            return 0
        data = gather_blocks(self.kv_caches, [block_id for block_id, _, _ in new])
        self.transport.submit(SaveJob(
            hashes=[block_hash for _, block_hash, _ in new],
            parents=[parent or b"" for _, _, parent in new], data=data,
            ready=self._mark(), owners=owners))
        self.stats.saved_blocks += len(new)
        return len(new)

    def wait(self, timeout_s: float) -> None:
        """Block until the transfer thread finishes something (the engine has nothing else)."""
        self.transport.wait(timeout_s)

    # ----- completions ------------------------------------------------------------
    def _probed(self, done: ProbeDone) -> None:
        request, start = self._probing.pop(done.request_id, (None, 0))
        if request is None or request.is_finished or not done.num_found:
            self._drop(done.lease)
            return
        pool = self.kv.pool
        local = self.kv.get_computed_blocks(request)
        evictable = sum(1 for block in local if block.ref_cnt == 0)
        # Local hits that changed meanwhile, or no room: the prompt is simply recomputed.
        if len(local) != start or pool.num_free_blocks < done.num_found + evictable:
            self._drop(done.lease)
            return
        pool.touch(local)  # held so that the fresh blocks below cannot evict them
        blocks = pool.get_new_blocks(done.num_found)
        self._loading[done.request_id] = _Loading(request, start, local, blocks)
        self.transport.submit(LoadJob(done.request_id, done.lease,
                                      [block.block_id for block in blocks], self._mark()))

    def _loaded(self, done: LoadDone) -> None:
        loading = self._loading.pop(done.request_id, None)
        if loading is None:
            return
        request, start, blocks = loading.request, loading.start, loading.blocks
        if done.ok:
            size = self.kv.block_size
            end = start + len(blocks)
            self.kv.pool.cache_full_blocks(
                blocks, request.block_hashes[start:end], request.token_ids(start * size,
                                                                           end * size),
                size, request.block_hashes[start - 1] if start else None, from_tier=True)
            self.stats.loaded_blocks += len(blocks)
            request.num_store_loaded_tokens += len(blocks) * size
        else:
            self.stats.failed_loads += 1
        # Tail first: the loaded blocks are evicted before the prefix they extend.
        self.kv.pool.free_blocks(reversed(blocks))
        self.kv.pool.free_blocks(reversed(loading.local))

    def _drop(self, lease: object | None) -> None:
        if lease is not None:
            self.transport.submit(DropJob(lease))

    def _mark(self) -> torch.cuda.Event | None:
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _block_bytes(self) -> int:
        k_cache = self.kv_caches[0][0]
        return 2 * len(self.kv_caches) * k_cache[0].numel() * k_cache.element_size()
