"""The placement reads of concurrent routes, coalesced into one Redis round trip.

    reads = PlacementReads(redis, registry, index_for, groups)
    records, matches = await reads.read(model, hashes)

Every route needs the live workers (the registry) and, per group of workers whose block
hashes agree, how many of its prompt's leading blocks each holder has (the block index).
Routes that ask in the same event-loop turn share one pipeline: one registry scan and one
prefix match per route and group. A burst of a thousand requests costs a few round trips
and registry scans instead of a thousand of each.

When Redis cannot be reached the reads are answered from the last registry view (with the
loads that heartbeats reported since, `note_load`) and no prefix matches: placement by load
only, `degraded` until a read succeeds again. A lost Redis never fails a route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from meshserve.shared.block_hash import BlockHash, ImageSpan, extra_keys_for, hash_blocks
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.redis_server import run_pipeline
from meshserve.shared.worker_registry import WorkerLoad, WorkerRecord, WorkerRegistry

_log = logging.getLogger(__name__)
REDIS_ERRORS = (OSError, aioredis.ConnectionError, aioredis.TimeoutError)
"""What a lost or stalled Redis raises."""

Group = tuple[str, int]
"""(kv namespace, block size): workers whose block hashes agree."""
Matches = dict[Group, dict[str, int]]
"""Per group: holder -> leading prompt blocks it holds."""


class PromptHashes:
    """A prompt's full-block hashes per block size, computed once per request."""

    def __init__(self, token_ids: tuple[int, ...], block_hashes: tuple[BlockHash, ...],
                 lora_id: int | None, cache_salt: str, mesh_block_size: int,
                 images: tuple[ImageSpan, ...] = ()) -> None:
        """`block_hashes`: hashes at `mesh_block_size`, used when there are no token ids;
        `images`: the prompt's images, hashed into their blocks as the workers do."""
        self._token_ids = token_ids
        self._images = images
        self._block_hashes = block_hashes
        self._mesh_block_size = mesh_block_size
        self._extra_keys = extra_keys_for(lora_id, cache_salt or None)
        self._by_size: dict[int, list[BlockHash]] = {}

    def get(self, block_size: int) -> list[BlockHash]:
        """Hashes of the prompt's full blocks at `block_size` (none if they cannot be known)."""
        hashes = self._by_size.get(block_size)
        if hashes is None:
            if self._token_ids:
                hashes = hash_blocks(self._token_ids, block_size, self._extra_keys,
                                     images=self._images)
            elif block_size == self._mesh_block_size:
                hashes = list(self._block_hashes)
            else:
                hashes = []
            self._by_size[block_size] = hashes
        return hashes


@dataclass
class _Ask:
    model: str
    hashes: PromptHashes
    groups: list[Group]
    answer: asyncio.Future[tuple[list[WorkerRecord], Matches]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class PlacementReads:
    """Reads for placement attempts, batched per event-loop turn (see the module doc)."""

    def __init__(self, redis: aioredis.Redis, registry: WorkerRegistry,
                 index_for: Callable[[str], KVIndex]) -> None:
        self._redis = redis
        self._registry = registry
        self._index_for = index_for
        self._groups: dict[str, set[Group]] = {}  # model -> groups seen at its last read
        self._asks: list[_Ask] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_records: dict[str, WorkerRecord] = {}  # the last registry view, by id
        self.degraded = False  # the last read found Redis unreachable
        self.num_degraded_reads = 0

    def remember(self, record: WorkerRecord) -> None:
        """A registration into the last registry view (before any read has seen it)."""
        self._last_records[record.worker_id] = record

    def note_load(self, worker_id: str, epoch: int, load: WorkerLoad, now_unix_ns: int
                  ) -> bool:
        """A heartbeat's load, received at `now_unix_ns`, into the last registry view;
        False for a worker not in it."""
        record = self._last_records.get(worker_id)
        if record is None or record.epoch != epoch:
            return False
        self._last_records[worker_id] = dataclasses.replace(
            record, load=load, last_heartbeat_unix_ns=now_unix_ns)
        return True

    def last_records(self, model: str | None = None) -> list[WorkerRecord]:
        """The last registry view (what placement uses while Redis is unreachable)."""
        return [r for r in self._last_records.values() if model is None or r.info.serves(model)]

    async def read(self, model: str, hashes: PromptHashes
                   ) -> tuple[list[WorkerRecord], Matches]:
        """The live workers and the prompt's prefix matches per group of `model`'s workers.

        The asks of one turn are answered together and in the order they asked, so that
        routes placed from one burst are placed first come, first served.
        """
        ask = _Ask(model, hashes, sorted(self._groups.get(model, ())))
        self._asks.append(ask)
        if len(self._asks) == 1:  # the first of this turn: read once the turn is over
            asyncio.get_running_loop().call_soon(self._flush)
        return await ask.answer

    def _flush(self) -> None:
        asks, self._asks = self._asks, []
        task = asyncio.ensure_future(self._run(asks))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, asks: list[_Ask]) -> None:
        try:
            try:
                answers = await self._read_all(asks)
            except REDIS_ERRORS as exc:
                answers = self._degraded_answers(asks, exc)
            else:
                if self.degraded:
                    _log.warning("Redis is back: placement reads the registry and the block "
                                 "index again")
                self.degraded = False
        except BaseException as exc:  # every asker gets the failure (cancellation too)
            for ask in asks:
                if not ask.answer.done():
                    ask.answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for ask, answer in zip(asks, answers, strict=True):
            if not ask.answer.done():
                ask.answer.set_result(answer)

    def _with_unlisted(self, records: list[WorkerRecord]) -> list[WorkerRecord]:
        """The registry's live workers, plus those of the last view that it no longer lists
        although their last heartbeat is younger than the TTL: Redis came back empty, and
        they register again at their next heartbeat. Without them every route in between
        would find no worker."""
        listed = {r.worker_id for r in records}
        alive_since = time.time_ns() - int(self._registry.ttl_s * 1e9)
        return records + [r for wid, r in self._last_records.items()
                          if wid not in listed and r.last_heartbeat_unix_ns > alive_since]

    def forget(self, worker_id: str) -> None:
        """A worker deregistered: out of the last view at once."""
        self._last_records.pop(worker_id, None)

    def mark_degraded(self, error: BaseException) -> None:
        """Redis failed a read: serve from the last view until a read succeeds."""
        if not self.degraded:
            _log.warning("Redis is unreachable (%s); placing by the last known load of %d "
                         "worker(s), without prefix matches, until it is back", error,
                         len(self._last_records))
        self.degraded = True
        self.num_degraded_reads += 1

    def _degraded_answers(self, asks: list[_Ask], error: BaseException
                          ) -> list[tuple[list[WorkerRecord], Matches]]:
        """The last registry view and no prefix matches, for each ask."""
        self.mark_degraded(error)
        records = list(self._last_records.values())
        nothing: Matches = {(r.info.namespace, r.info.block_size): {} for r in records}
        return [(list(records), dict(nothing)) for _ in asks]

    async def _read_all(self, asks: list[_Ask]) -> list[tuple[list[WorkerRecord], Matches]]:
        def build(pipe: Pipeline) -> None:
            self._registry.queue_scan(pipe)
            for ask in asks:
                for namespace, block_size in ask.groups:
                    self._index_for(namespace).queue_match(pipe, ask.hashes.get(block_size))

        raw = await run_pipeline(self._redis, build, self._scripts(
            group for ask in asks for group in ask.groups))
        records = self._with_unlisted(await self._registry.records_from_scan(raw[0]))
        self._last_records = {r.worker_id: r for r in records}
        position = 1
        matches: list[Matches] = []
        for ask in asks:
            found: Matches = {}
            for group in ask.groups:
                found[group] = KVIndex.parse_match(raw[position])
                position += 1
            matches.append(found)
        await self._read_new_groups(asks, records, matches)
        return [(list(records), found) for found in matches]

    async def _read_new_groups(self, asks: list[_Ask], records: list[WorkerRecord],
                               matches: list[Matches]) -> None:
        """Match the groups the registry shows that the asks did not know (one round trip)."""
        for model in {ask.model for ask in asks}:
            self._groups[model] = {(r.info.namespace, r.info.block_size) for r in records
                                   if r.info.serves(model)}
        missing = [(found, ask.hashes, group) for ask, found in zip(asks, matches, strict=True)
                   for group in sorted(self._groups[ask.model] - set(ask.groups))]
        if not missing:
            return

        def build(pipe: Pipeline) -> None:
            for _, hashes, (namespace, block_size) in missing:
                self._index_for(namespace).queue_match(pipe, hashes.get(block_size))

        raw = await run_pipeline(self._redis, build,
                                 self._scripts(group for _, _, group in missing))
        for (found, _, group), reply in zip(missing, raw, strict=True):
            found[group] = KVIndex.parse_match(reply)

    def _scripts(self, groups: Iterable[Group]) -> list[Any]:
        namespaces = {namespace for namespace, _ in groups}
        return [*self._registry.scripts,
                *(self._index_for(next(iter(namespaces))).scripts if namespaces else ())]
