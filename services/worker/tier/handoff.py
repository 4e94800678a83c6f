"""The KV handoff of disaggregated serving: a prefilled prompt's KV, prefill to decode worker.

A prefill worker computes a request's prompt and first tokens (GenerateRequest.prefill_only)
and then `send`s the prompt's KV; the gateway moves the request to the decode worker the
router chose, which continues it after those tokens and `receive`s the KV before computing.

`KvHandoff` is the transfer interface; `StoreHandoff` is its first transport, the KV tier:
the prefill worker's engine writes every full prompt block to the kvstore right after the
step that computes it (tier/kv_tier.py), so sending is waiting until those writes are done;
the decode worker loads them by block hash as prefix-cache hits from the store at admission
(its partial last block and the first tokens are recomputed: a few tokens). A handoff that
is not in the store in time costs the decode worker a recomputation, nothing else.
`TcpHandoff` (over tier/tcp_handoff.py's transfer) is the second: the prefill worker holds
the blocks and names where (`source`), the decode worker pulls them over parallel TCP
streams, or, with the blocks in a pool it can map on the same host (--kv-handoff ipc,
tier/slot_pool.py), copies them GPU to GPU; or the prefill worker pushes them into the
decode worker's own pool as it computes them (tier/kv_push.py).

The decode worker first checks it has room (`has_room`): a handed-off request whose prompt
blocks would leave less than the watermark free is refused before anything runs, and the
gateway places it elsewhere. The free blocks it reads are the engine's after its last step,
less the blocks already promised to handed-off requests that passed the check and are not
allocated yet (`RoomReservations`, one per worker): two handoffs arriving in one step cannot
both take the same room. Other transports (NCCL, RDMA through UCX) fit behind the same
calls: `send` makes the blocks reachable and says where, `expect` tells the decode side
where a request's blocks wait, and the engine's KV tier pulls them into blocks it allocated
first (tier/kv_tier.py's probe, then load).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Gauge

if TYPE_CHECKING:
    from meshserve.services.worker.tier.tcp_blocks import BlockServer
    from meshserve.services.worker.tier.tcp_handoff import TcpTransfer

# Longest a prefill worker waits for its prompt blocks to reach the store; past it the
# request moves on anyway and the decode worker computes what is missing.
DEFAULT_SEND_TIMEOUT_S = 10.0
# Fraction of its KV cache a decode worker keeps free when it takes a handed-off prompt
# (as vLLM's block-manager watermark: room for running sequences to grow).
DEFAULT_WATERMARK = 0.01


@dataclass
class HandoffStats:
    """Counters since start, for meshserve:kv_handoff_blocks_total."""

    sent_blocks: int = 0
    received_blocks: int = 0
    late_sends: int = 0
    """Sends that did not finish within their timeout, or found the transport away."""
    refused: int = 0
    """Handed-off requests this decode worker had no room for (placed elsewhere)."""


class KvHandoff(Protocol):
    """Moves prompt KV from a prefill worker to a decode worker."""

    stats: HandoffStats
    block_size: int
    """Tokens per KV block: a prompt's full blocks are what is handed off."""
    source: str
    """Where this prefill worker's handed-off blocks wait ("": the kvstore)."""
    watermark: float
    """Decode side: the fraction of the KV cache kept free when taking a handoff."""

    async def send(self, num_blocks: int, request_id: str = "") -> bool:
        """Prefill side: make request `request_id`'s `num_blocks` full prompt blocks,
        computed by the steps already run, reachable to the decode worker; False when that
        did not finish in time (the decode worker then recomputes what it lacks)."""
        ...

    def source_of(self, request_id: str) -> str:
        """Prefill side, after `send`: where the request's blocks wait (its
        RequestDone.kv_source): `source`, or the decode worker's own pool they were pushed
        into."""
        ...

    def target(self, request_id: str, address: str) -> None:
        """Prefill side: the request's decode worker takes pushed blocks at `address`
        (GenerateRequest.kv_target; before it is submitted to the engine)."""
        ...

    def receive(self, num_blocks: int) -> None:
        """Decode side: `num_blocks` prompt blocks of a handed-off request were found in the
        cache when it was admitted (loaded from the handoff)."""
        ...

    def expect(self, request_id: str, source: str) -> None:
        """Decode side: request `request_id`'s blocks wait at `source` (before it is
        submitted to the engine)."""
        ...

    def forget(self, request_id: str) -> None:
        """Decode side: the request ended; drop what `expect` noted."""
        ...


class StoreHandoff:
    """The KV tier as the handoff transport: `flush` waits for the transfer thread's
    queued writes to the kvstore (KVTransfer.flush); `reachable` says whether the store
    answered (a write to a store that is away is dropped, not sent)."""

    def __init__(self, flush: Callable[[float], bool], block_size: int, *,
                 reachable: Callable[[], bool] = lambda: True,
                 timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                 watermark: float = DEFAULT_WATERMARK) -> None:
        self._flush = flush
        self.watermark = watermark
        self._reachable = reachable
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.stats = HandoffStats()
        self.source = ""

    async def send(self, num_blocks: int, request_id: str = "") -> bool:
        done = await asyncio.to_thread(self._flushed, request_id) and self._reachable()
        if done:
            self.stats.sent_blocks += num_blocks
        else:
            self.stats.late_sends += 1
        return done

    def receive(self, num_blocks: int) -> None:
        self.stats.received_blocks += num_blocks

    def _flushed(self, request_id: str) -> bool:
        """Whether the transfer's writes (those of `request_id`'s blocks) finished in
        time."""
        return self._flush(self.timeout_s)

    def source_of(self, request_id: str) -> str:
        return self.source

    def target(self, request_id: str, address: str) -> None:
        pass  # the store carries every block

    def expect(self, request_id: str, source: str) -> None:
        pass  # the engine asks the store for any prompt it lacks

    def forget(self, request_id: str) -> None:
        pass


def has_room(num_blocks: int, num_free_blocks: int, num_total_blocks: int,
             watermark: float) -> bool:
    """Whether a decode worker with `num_free_blocks` of `num_total_blocks` free takes a
    handed-off prompt of `num_blocks` blocks and still keeps `watermark` of its cache free
    (room for its running sequences to grow without preemption)."""
    return num_free_blocks - num_blocks >= watermark * num_total_blocks


class RoomReservations:
    """Decode side: the KV blocks promised to handed-off requests that passed the room check
    but that the engine has not allocated yet, over every session of the worker.

    A request reserves its prompts' full blocks when it is taken; a prompt's share is
    released when its first output comes back (the engine allocated its blocks when it
    admitted it, and the free blocks read after that step count them), the rest when the
    request ends in any way (finished, aborted, failed, its session closed). Until then the
    room check counts them as taken. Only the event loop touches it.
    """

    def __init__(self) -> None:
        self._held: dict[object, dict[int, int]] = {}  # owner -> prompt index -> blocks
        self.reserved = 0
        """Blocks reserved now (the sum of every owner's)."""

    def has_room(self, num_blocks: int, num_free_blocks: int, num_total_blocks: int,
                 watermark: float) -> bool:
        """`has_room`, with the reserved blocks counted as taken."""
        return has_room(num_blocks, num_free_blocks - self.reserved, num_total_blocks,
                        watermark)

    def reserve(self, owner: object, prompt_blocks: Sequence[int]) -> None:
        """Reserve `prompt_blocks[p]` blocks for prompt p of `owner` (one request)."""
        assert owner not in self._held, "a request reserves its blocks once"
        held = {p: blocks for p, blocks in enumerate(prompt_blocks) if blocks > 0}
        if held:
            self._held[owner] = held
            self.reserved += sum(held.values())

    def release(self, owner: object, prompt: int | None = None) -> None:
        """Release prompt `prompt`'s blocks of `owner` (None: all it still holds); what
        is not held is ignored."""
        held = self._held.get(owner)
        if held is None:
            return
        for p in list(held) if prompt is None else [prompt]:
            self.reserved -= held.pop(p, 0)
        if not held:
            del self._held[owner]

    def __len__(self) -> int:
        """Requests holding a reservation."""
        return len(self._held)


class TcpHandoff(StoreHandoff):
    """`KvHandoff` over a `TcpTransfer`: `source` is the prefill worker's listener. Sending
    waits for the transfer thread to hold the blocks (as the store's writes are waited for);
    the decode side tells the transfer where each request's blocks are."""

    def __init__(self, transfer: TcpTransfer, block_size: int, source: str = "", *,
                 timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                 watermark: float = DEFAULT_WATERMARK) -> None:
        super().__init__(transfer.flush, block_size, timeout_s=timeout_s, watermark=watermark)
        self.transfer = transfer
        self.source = source
        self._sent: dict[str, str] = {}  # request id -> where its pushed blocks wait

    def _flushed(self, request_id: str) -> bool:
        if not request_id:
            return self.transfer.flush(self.timeout_s)
        return self.transfer.flush_request(request_id, self.timeout_s)

    async def send(self, num_blocks: int, request_id: str = "") -> bool:
        """Wait for the request's held blocks (not for later steps' saves), then commit the
        pushed ones (their own source)."""
        done = await super().send(num_blocks, request_id)
        if self.transfer.pusher is not None and request_id:
            pushed = await asyncio.to_thread(self.transfer.commit, request_id)
            if pushed:
                self._sent[request_id] = pushed
        return done

    def source_of(self, request_id: str) -> str:
        return self._sent.pop(request_id, self.source)

    def target(self, request_id: str, address: str) -> None:
        if self.transfer.pusher is not None and address:
            self.transfer.pusher.target(request_id, address)

    def expect(self, request_id: str, source: str) -> None:
        self.transfer.expect(request_id, source)

    def forget(self, request_id: str) -> None:
        self.transfer.forget(request_id)
        if self.transfer.pusher is not None:
            self.transfer.pusher.forget(request_id)


def register_handoff_metrics(registry: CollectorRegistry, handoff: KvHandoff) -> None:
    """meshserve:kv_handoff_blocks_total{direction="sent"|"received"}, read at scrape time."""
    blocks = Gauge("meshserve:kv_handoff_blocks_total",
                   "Prompt KV blocks handed off by this prefill worker (sent) or found at "
                   "admission of handed-off requests on this decode worker (received)",
                   ["direction"], registry=registry)
    blocks.labels("sent").set_function(lambda: handoff.stats.sent_blocks)
    blocks.labels("received").set_function(lambda: handoff.stats.received_blocks)
    Gauge("meshserve:kv_handoff_refusals_total",
          "Handed-off requests this decode worker refused for lack of KV room (the gateway "
          "placed them elsewhere)", registry=registry
          ).set_function(lambda: handoff.stats.refused)
    Gauge("meshserve:kv_handoff_late_sends_total",
          "Handoffs whose KV was not in the store within the send timeout (the decode worker "
          "recomputes what it lacks)", registry=registry
          ).set_function(lambda: handoff.stats.late_sends)


def register_tcp_metrics(registry: CollectorRegistry, transfer: TcpTransfer,
                         server: BlockServer | None = None) -> None:
    """The direct handoff's gauges: held bytes and freed blocks (a prefill worker's, or
    a decode worker's pushed blocks, served by `server`), pulls (decode), pushes
    (prefill), and slots reserved for pushes (a decode worker's pool)."""
    holder = server.holder if server is not None else transfer.holder
    read: list[tuple[str, str, Callable[[], float]]] = [
        ("kv_handoff_pulled_bytes_total", "Bytes of KV blocks pulled from prefill workers",
         lambda: transfer.stats.pulled_bytes),
        ("kv_handoff_pull_seconds_total", "Seconds spent pulling KV blocks over TCP",
         lambda: transfer.stats.pull_seconds),
        ("kv_handoff_failed_pulls_total",
         "Pulls that failed or found the source gone (the prompt was recomputed)",
         lambda: transfer.stats.failed_pulls),
        ("kv_handoff_mapped_blocks_total",
         "KV blocks copied straight from a prefill worker's mapped pool (GPU to GPU)",
         lambda: transfer.stats.mapped_blocks)]
    pusher = transfer.pusher
    if pusher is not None:
        read += [
            ("kv_handoff_pushed_blocks_total",
             "KV blocks written into a decode worker's pool layer by layer as computed",
             lambda: pusher.stats.pushed_blocks),
            ("kv_handoff_refused_reservations_total",
             "Requests whose decode worker had no room for their pushed blocks (held here)",
             lambda: pusher.stats.refused_reservations)]
    if holder is not None:
        read += [
            ("kv_handoff_held_bytes",
             ("Bytes of handed-off KV blocks held: a prefill worker's for decode workers, a "
             "decode worker's pushed into its pool and not yet loaded"),
             lambda: holder.held_bytes),
            ("kv_handoff_dropped_store_saves_total",
             "Blocks held for the handoff but not written to a kvstore that fell behind",
             lambda: transfer.stats.dropped_store_saves),
            ("kv_handoff_expired_blocks_total",
             "Held KV blocks freed unloaded (hold time or byte bound)",
             lambda: holder.stats.expired_blocks)]
    pending = server.pending if server is not None and transfer.holder is None else None
    if pending is not None:
        read.append(("kv_handoff_reserved_slots",
                     ("Slots of this decode worker's pool reserved for prefill workers' "
                     "pushes, not yet written"), lambda: len(pending)))
    for name, doc, fn in read:
        Gauge(f"meshserve:{name}", doc, registry=registry).set_function(fn)
