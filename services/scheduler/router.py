"""The router: live workers and prefix hits from Redis, the policy, the global queue.

One placement attempt reads the registry and the block index in ONE Redis round trip
(a pipeline of two kinds of Lua script; the attempts of one event-loop turn share it,
reads.py), adds the provisional load of requests this
replica routed since each worker's last heartbeat, and asks the policy. When every
worker is full the request waits in the global queue, which retries on every change of
load: heartbeats, releases and registrations, whichever scheduler replica received them
(they are published on a Redis channel that every replica listens to). A request whose
estimated wait to start passes its bound is refused instead of queueing (wait_estimate.py:
from the requests queued, those in service and their mean time from route to release).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from meshserve.services.scheduler.disagg import (
    DEFAULT_MIN_PROMPT_TOKENS,
    pick_decode,
    split_pools,
)
from meshserve.services.scheduler.inflight import Assignment, InFlight
from meshserve.services.scheduler.policy import Candidate, RoutingPolicy
from meshserve.services.scheduler.queue import GlobalQueue
from meshserve.services.scheduler.reads import (
    REDIS_ERRORS,
    Group,
    PlacementReads,
    PromptHashes,
)
from meshserve.services.scheduler.wait_estimate import WaitEstimator
from meshserve.shared.block_hash import BlockHash, ImageSpan
from meshserve.shared.errors import InvalidRequestError, NotFoundError, UnavailableError
from meshserve.shared.kv_index import KVSTORE_HOLDER_PREFIX, KVIndex
from meshserve.shared.worker_registry import (
    LOAD_CHANNEL,
    RUNNER_GENERATE,
    RUNNER_POOLING,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WorkerRegistry,
)

_log = logging.getLogger(__name__)
_HASH_BYTES = 32


@dataclass(frozen=True)
class RouteQuery:
    """One request to place, as the router needs it."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = ()
    block_hashes: tuple[BlockHash, ...] = ()
    """Full-block hashes at the mesh's block size; used when there are no token ids."""
    num_prompt_tokens: int = 0
    lora_id: int | None = None
    cache_salt: str = ""
    priority: int = 0
    deadline: float | None = None
    """When the request gives up waiting, in the event loop's clock (None: never)."""
    expected_output_tokens: int = 0
    num_sequences: int = 1
    exclude_worker_ids: frozenset[str] = frozenset()
    runner: str = RUNNER_GENERATE
    """The kind of worker the request needs (generation or pooling)."""
    images: tuple[ImageSpan, ...] = ()
    """The prompt's images: keys of the blocks holding their placeholders."""
    max_queue_delay_s: float = 0.0
    """Refuse at once when every worker is full and the estimated wait to start passes
    this (or the time left to `deadline`); 0: no refusal by estimate."""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if not self.model:
            raise InvalidRequestError("model must not be empty", param="model")
        if not self.prompt_token_ids and self.num_prompt_tokens <= 0:
            raise InvalidRequestError("give prompt_token_ids, or num_prompt_tokens (with the "
                                      "block_hashes of its full blocks)", param="prompt_token_ids")
        bad = [i for i, h in enumerate(self.block_hashes) if len(h) != _HASH_BYTES]
        if bad:
            raise InvalidRequestError(f"block_hashes[{bad[0]}] has {len(self.block_hashes[bad[0]])}"
                                      f" bytes, expected {_HASH_BYTES}", param="block_hashes")
        if self.num_sequences < 1:
            raise InvalidRequestError(f"num_sequences must be >= 1, got {self.num_sequences}",
                                      param="num_sequences")
        if any(len(image.digest) != _HASH_BYTES for image in self.images):
            raise InvalidRequestError(f"an image hash must have {_HASH_BYTES} bytes",
                                      param="images")

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids) or self.num_prompt_tokens


@dataclass(frozen=True)
class HandoffTarget:
    """The decode worker a prefilled request continues on (disaggregated serving)."""

    worker_id: str
    address: str
    epoch: int
    kv_address: str = ""
    """Its KV handoff listener, where pushed KV goes (WorkerInfo.kv_handoff_address)."""


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes, and what the policy saw of the chosen worker."""

    worker_id: str
    address: str
    epoch: int
    block_size: int
    num_matched_blocks: int
    """Leading prompt blocks the worker holds on its device."""
    num_kvstore_blocks: int
    """Further leading prompt blocks the kvstore holds (past the worker's own)."""
    queued_ns: int = 0
    policy: str = ""
    """Name of the routing policy that chose."""
    score: float = 0.0
    """The policy's score of the worker (kv-aware: its cost; 0: the policy does not score)."""
    num_prompt_tokens: int = 0
    num_prompt_blocks: int = 0
    """Blocks the prompt needs at the worker's block size (the partial block counted)."""
    num_running: int = 0
    """The worker's running sequences when chosen (this replica's provisions included)."""
    num_waiting: int = 0
    num_used_blocks: int = 0
    decode: HandoffTarget | None = None
    """Set when `worker_id` only prefills: the decode worker that continues the request."""

    @property
    def num_matched_tokens(self) -> int:
        """Prompt tokens the worker holds on its device."""
        return min(self.num_matched_blocks * self.block_size, self.num_prompt_tokens)

    @property
    def overlap(self) -> float:
        """Fraction of the prompt's blocks the worker holds on its device."""
        return self.num_matched_blocks / self.num_prompt_blocks if self.num_prompt_blocks else 0.0


class Router:
    """Places requests on workers; keeps the registry in Redis and the local provisions."""

    def __init__(self, redis: aioredis.Redis, registry: WorkerRegistry, policy: RoutingPolicy,
                 queue: GlobalQueue, *, block_size: int,
                 clock_ns: Callable[[], int] = time.time_ns,
                 on_route: Callable[[RouteDecision], None] | None = None,
                 disagg_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
                 registration_grace_s: float = 0.0) -> None:
        """`block_size`: the mesh's block size, for queries that bring block hashes;
        `disagg_min_prompt_tokens`: shorter prompts skip the prefill workers (disagg.py);
        `registration_grace_s`: for this long after the router is made, a request for a
        model no live worker serves waits in the global queue instead of failing (a
        restarted scheduler: the workers' records expired while it was away, and they
        register again at their next heartbeat); and as long after a worker serving the
        model last heartbeated or registered here (a Redis that came back empty, a worker
        being restarted)."""
        self.redis = redis
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.registry = registry
        self.policy = policy
        self.queue = queue
        self.block_size = block_size
        self._clock_ns = clock_ns
        self._on_route = on_route
        self.inflight = InFlight()
        self.waits = WaitEstimator()
        self._indexes: dict[str, KVIndex] = {}
        self._reads = PlacementReads(redis, registry, self._index)
        self._listener: asyncio.Task[None] | None = None
        self._grace_s = registration_grace_s
        self._grace_ends = time.monotonic() + registration_grace_s
        self._grace_timer: asyncio.TimerHandle | None = None
        # worker id -> (monotonic time of its last registration or heartbeat here, info)
        self._contacts: dict[str, tuple[float, WorkerInfo]] = {}

    async def start(self) -> None:
        """Listen for load changes published by every replica (subscribed on return)."""
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(LOAD_CHANNEL)
        self._listener = asyncio.create_task(self._listen(pubsub), name="router-load-listener")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None

    async def _listen(self, pubsub: Any) -> None:
        try:
            while True:
                try:
                    if not pubsub.subscribed:
                        await pubsub.subscribe(LOAD_CHANNEL)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.queue.notify()
                except (OSError, aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                    # Redis went away; local changes still wake the queue meanwhile.
                    _log.warning("load channel lost (%s); subscribing again", exc)
                    await asyncio.sleep(1.0)  # reconnect backoff
        finally:
            await pubsub.aclose()

    # Registry, for the servicer. Every change wakes the queue.
    async def register(self, info: WorkerInfo, load: WorkerLoad) -> int:
        epoch = await self.registry.register(info, load)
        self._reads.remember(WorkerRecord(info, load, epoch, self._clock_ns()))
        self._contacts[info.worker_id] = (time.monotonic(), info)
        self.queue.notify()
        return epoch

    async def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad) -> bool:
        try:
            ok = await self.registry.heartbeat(worker_id, epoch, load)
        except REDIS_ERRORS:
            # Redis is away: keep the load for placement; the worker stays registered here
            # and is told to register again by the first heartbeat after Redis is back.
            ok = self._reads.note_load(worker_id, epoch, load, self._clock_ns())
        if ok:
            contact = self._contacts.get(worker_id)
            if contact is not None:
                self._contacts[worker_id] = (time.monotonic(), contact[1])
            self.queue.notify()
        return ok

    async def deregister(self, worker_id: str, epoch: int | None) -> bool:
        removed = await self.registry.deregister(worker_id, epoch)
        self._reads.forget(worker_id)
        self._contacts.pop(worker_id, None)
        self.queue.notify()
        return removed

    async def list_workers(self, model: str | None = None) -> list[WorkerRecord]:
        try:
            return await self.registry.live_workers(model)
        except REDIS_ERRORS as exc:
            self._reads.mark_degraded(exc)
            return self._reads.last_records(model)

    @property
    def degraded(self) -> bool:
        """Whether placement last found Redis unreachable (load only, no prefix matches)."""
        return self._reads.degraded

    def release(self, request_id: str, worker_id: str) -> bool:
        """A routed request ended: drop its provisional load now."""
        now = self._clock_ns()
        released = self.inflight.release(request_id, worker_id, now)
        if released is None:
            return False
        self.waits.observe((now - released.routed_unix_ns) / 1e9)
        self.queue.notify()
        return True

    def wait_estimate(self) -> float | None:
        """Seconds a request that found every worker full now would wait to start."""
        return self.waits.estimate(len(self.queue), len(self.inflight), self._age_s())

    def _age_s(self) -> float | None:
        """How long the requests in flight have been so, on average (None: none is)."""
        routed = self.inflight.mean_routed_unix_ns()
        return None if routed is None else max(0.0, (self._clock_ns() - routed) / 1e9)

    async def route(self, query: RouteQuery) -> RouteDecision:
        """Pick a worker, waiting in the global queue while every worker is full.

        UnavailableError when no live worker serves the model, OverloadedError when the
        queue is full, DeadlineExceededError when the query's deadline passes.
        """
        hashes = PromptHashes(query.prompt_token_ids, query.block_hashes, query.lora_id,
                              query.cache_salt, self.block_size, query.images)
        started = time.monotonic_ns()
        last_try = [started]

        async def attempt() -> RouteDecision | None:
            last_try[0] = time.monotonic_ns()
            return await self._try_place(query, hashes)

        decision = await self.queue.run(attempt, priority=query.priority,
                                        deadline=query.deadline,
                                        admit=lambda ahead: self._admit(query, ahead))
        decision = dataclasses.replace(decision, queued_ns=max(0, last_try[0] - started))
        if self._on_route is not None:
            self._on_route(decision)
        return decision

    def _admit(self, query: RouteQuery, ahead: int) -> None:
        """Refuse a request about to queue behind `ahead` others when its estimated wait
        passes its max_queue_delay_s or the time left to its deadline."""
        if query.max_queue_delay_s <= 0:
            return
        bound = query.max_queue_delay_s
        if query.deadline is not None:
            bound = min(bound, query.deadline - asyncio.get_running_loop().time())
        error = self.waits.refusal(ahead, len(self.inflight), bound, self._age_s())
        if error is not None:
            raise error

    async def _try_place(self, query: RouteQuery, hashes: PromptHashes) -> RouteDecision | None:
        records, matches = await self._reads.read(query.model, hashes)
        self.inflight.keep_only({r.worker_id for r in records})
        serving = _with_lora(query, _runners_of(
            query, [r for r in records if r.info.serves(query.model)]))
        usable = [r for r in serving if r.worker_id not in query.exclude_worker_ids]
        if not usable:
            if not serving and self._workers_may_register(query.model):
                return None  # queued: a registration (or the grace's end) tries it again
            raise UnavailableError(
                f"no live worker serves model {query.model!r}"
                + (f" besides {sorted(query.exclude_worker_ids)}" if serving else ""),
                param="model")
        pools = split_pools(usable, query.prompt_len, self.disagg_min_prompt_tokens)
        candidates = {r.worker_id: self._candidate(r, query, matches) for r in pools.first}
        choice = self.policy.choose(list(candidates.values()))
        if choice is None:
            return None
        record = next(r for r in pools.first if r.worker_id == choice.worker_id)
        decision = self._assign(record, choice, query)
        if not pools.disaggregated:
            return decision
        return self._with_decode(decision, pools.decode, query, matches)

    def _workers_may_register(self, model: str) -> bool:
        """Whether a worker serving `model` may register soon: the registration grace of a
        young router still runs, or one such worker heartbeated or registered here less
        than the grace ago (the registry lost it: Redis came back empty, or it is being
        restarted). The grace's end wakes the global queue, so that a request still
        waiting for a worker fails then."""
        now = time.monotonic()
        self._contacts = {wid: (seen, info) for wid, (seen, info) in self._contacts.items()
                          if seen + self._grace_s > now}  # ids of pods long gone go
        ends = max([self._grace_ends] + [seen + self._grace_s for seen, info
                                         in self._contacts.values() if info.serves(model)])
        if ends <= now:
            return False
        if self._grace_timer is None or self._grace_timer.when() < ends:
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            loop = asyncio.get_running_loop()
            self._grace_timer = loop.call_at(loop.time() + (ends - now), self.queue.notify)
        return True

    def _with_decode(self, decision: RouteDecision, pool: list[WorkerRecord],
                     query: RouteQuery, matches: Mapping[Group, dict[str, int]]
                     ) -> RouteDecision:
        """`decision` (a prefill worker's) with the decode worker that continues it; as it
        is (the prefill worker runs the whole request) when no decode worker has room."""
        candidates = [self._candidate(r, query, matches) for r in pool]
        needed = math.ceil((query.prompt_len + query.expected_output_tokens)
                           * query.num_sequences / max(1, decision.block_size))
        choice = pick_decode([c for c in candidates if self.policy.is_open(c)], needed)
        if choice is None:
            return decision
        record = next(r for r in pool if r.worker_id == choice.worker_id)
        self._assign(record, choice, query)
        return dataclasses.replace(decision, decode=HandoffTarget(
            record.worker_id, record.info.address, record.epoch,
            record.info.kv_handoff_address))

    def _index(self, namespace: str) -> KVIndex:
        index = self._indexes.get(namespace)
        if index is None:
            index = self._indexes[namespace] = KVIndex(self.redis, namespace)
        return index

    def _candidate(self, record: WorkerRecord, query: RouteQuery,
                   matches: Mapping[Group, dict[str, int]]) -> Candidate:
        load, info = record.load, record.info
        group = matches[(info.namespace, info.block_size)]
        in_kvstore = max((count for holder, count in group.items()
                          if holder.startswith(KVSTORE_HOLDER_PREFIX)), default=0)
        extra = self.inflight.extra_load(record.worker_id, record.epoch,
                                         record.last_heartbeat_unix_ns,
                                         load.num_running + load.num_waiting)
        # Per sequence, shared prefixes counted in full; a worker that does not report its
        # active tokens is weighed by its blocks in use.
        active = (math.ceil(load.num_active_tokens / info.block_size)
                  if load.num_active_tokens else load.num_used_blocks)
        free = max(0, load.num_free_blocks - extra.num_blocks)
        return Candidate(
            worker_id=record.worker_id,
            num_running=max(0, load.num_running + extra.num_sequences),
            num_waiting=load.num_waiting,
            num_used_blocks=max(0, load.num_used_blocks + extra.num_blocks),
            num_free_blocks=min(free, load.num_total_blocks) if load.num_total_blocks else free,
            num_total_blocks=load.num_total_blocks, max_running=load.max_running,
            num_active_blocks=max(0, active + extra.num_active_blocks),
            draining=load.draining, num_prompt_blocks=math.ceil(query.prompt_len / info.block_size),
            num_matched_blocks=group.get(record.worker_id, 0),
            num_kvstore_prefix_blocks=in_kvstore)

    def _assign(self, record: WorkerRecord, choice: Candidate, query: RouteQuery
                ) -> RouteDecision:
        """Record the provisional load of the choice and describe it."""
        info = record.info
        output_blocks = math.ceil(query.expected_output_tokens * query.num_sequences
                                  / info.block_size)
        context_blocks = math.ceil((query.prompt_len + query.expected_output_tokens)
                                   / info.block_size)
        self.inflight.add(Assignment(
            request_id=query.request_id, worker_id=record.worker_id, epoch=record.epoch,
            num_sequences=query.num_sequences, num_blocks=choice.prefill_blocks + output_blocks,
            routed_unix_ns=self._clock_ns(),
            num_active_blocks=context_blocks * query.num_sequences))
        return RouteDecision(
            worker_id=record.worker_id, address=info.address, epoch=record.epoch,
            block_size=info.block_size, num_matched_blocks=choice.num_matched_blocks,
            num_kvstore_blocks=choice.store_blocks, policy=self.policy.name,
            score=self.policy.score(choice), num_prompt_tokens=query.prompt_len,
            num_prompt_blocks=choice.num_prompt_blocks, num_running=choice.num_running,
            num_waiting=choice.num_waiting, num_used_blocks=choice.num_used_blocks)


def _with_lora(query: RouteQuery, serving: list[WorkerRecord]) -> list[WorkerRecord]:
    """The workers of `serving` that have the query's LoRA adapter loaded; NotFoundError
    when the model is served but no worker has the adapter."""
    if query.lora_id is None:
        return serving
    having = [r for r in serving if query.lora_id in r.info.lora_ids]
    if serving and not having:
        raise NotFoundError(f"no live worker of model {query.model!r} has the LoRA adapter "
                            f"{query.lora_id} loaded", param="model")
    return having


def _runners_of(query: RouteQuery, serving: list[WorkerRecord]) -> list[WorkerRecord]:
    """The workers of `serving` that run the query's kind; InvalidRequestError when the model
    is served, but only by workers of the other kind (an embedding model asked to generate,
    or a generation model asked for embeddings)."""
    fitting = [r for r in serving if r.info.runner == query.runner]
    if serving and not fitting:
        if query.runner == RUNNER_POOLING:
            raise InvalidRequestError(
                f"model {query.model!r} is a generation model: it does not serve embeddings "
                "(no worker runs it with --runner pooling)", param="model")
        raise InvalidRequestError(
            f"model {query.model!r} is an embedding model (its workers run --runner "
            "pooling): it serves /v1/embeddings, not text generation", param="model")
    return fitting
