"""Publishes what the kvstore holds to the Redis block index, as holder `kvstore:<id>`.

The store logs its changes (stored, evicted) as KV events; after every Put the service
calls `publish()`, which applies them per namespace in one round trip each, under an
epoch claimed once per namespace and increasing sequence numbers. Publishing is
serialised, so batches reach Redis in order. When Redis is unreachable the events wait
for the next publish; when the index refuses the epoch (another process took this id),
the publisher claims a new epoch and sends the namespace's full holdings.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from meshserve.services.kvstore.store import KVBlockStore
from meshserve.shared.kv_events import BlockStored, KVEvent
from meshserve.shared.kv_index import KVIndex, holder_namespaces, kvstore_holder

_log = logging.getLogger(__name__)


class HoldingsPublisher:
    """Keeps the block index in step with one KVBlockStore."""

    def __init__(self, redis: aioredis.Redis, store_id: str, store: KVBlockStore) -> None:
        self.redis = redis
        self.holder = kvstore_holder(store_id)
        self._store = store
        self._lock = asyncio.Lock()
        self._pending: dict[str, list[KVEvent]] = {}
        self._epochs: dict[str, int] = {}
        self._seqs: dict[str, int] = {}
        self._indexes: dict[str, KVIndex] = {}

    async def reset(self) -> None:
        """At start: forget what an earlier run of this store left in the index."""
        for namespace in await holder_namespaces(self.redis, self.holder):
            await self._index(namespace).clear_holder(self.holder)

    async def publish(self) -> None:
        """Send the store's changes since the last publish (kept for later if Redis fails)."""
        async with self._lock:
            for namespace, events in self._store.take_changes().items():
                self._pending.setdefault(namespace, []).extend(events)
            for namespace in list(self._pending):
                try:
                    await self._publish(namespace)
                except (RedisError, OSError) as exc:
                    _log.warning("cannot publish kvstore holdings of %s (will retry): %s",
                                 namespace, exc, extra={"kv_namespace": namespace})

    async def _publish(self, namespace: str) -> None:
        index = self._index(namespace)
        if namespace not in self._epochs:
            self._epochs[namespace] = await index.claim_epoch(self.holder)
            self._seqs[namespace] = 0
        seq = self._seqs[namespace] + 1
        applied = await index.apply_events(self.holder, self._epochs[namespace], seq,
                                           self._pending[namespace])
        if not applied:
            _log.warning("block index refused epoch %d of %s; resending holdings",
                         self._epochs[namespace], self.holder,
                         extra={"kv_namespace": namespace})
            self._epochs[namespace] = await index.claim_epoch(self.holder)
            seq = 1
            everything = BlockStored(block_hashes=tuple(self._store.hashes(namespace)),
                                     parent_hash=None, token_ids=(), block_size=0)
            await index.apply_events(self.holder, self._epochs[namespace], seq, [everything])
        self._seqs[namespace] = seq
        del self._pending[namespace]

    def _index(self, namespace: str) -> KVIndex:
        index = self._indexes.get(namespace)
        if index is None:
            index = self._indexes[namespace] = KVIndex(self.redis, namespace)
        return index
