"""The gateway's channels, stubs and data-plane streams: tokenizers, scheduler, workers.

Channels are opened once and reused by every request (a channel multiplexes calls over
one HTTP/2 connection); worker channels are opened on first use of a worker address
and cached by address. Every channel carries the mesh's deadlines, retries for
idempotent methods and trace-context propagation (`GrpcClient`). The data plane is one
Session stream per worker and one DetokenizeSession stream per tokenizer replica,
shared by every request of this gateway and opened again on first use after one broke.
Requests whose DetokenizeSession broke wait, together, for a replica that answers its
health check (`recover_detokenize_stream`): another replica, or the same address once the
replica is back, probed with a growing pause on a fresh channel each time. A route whose
RouteSession stream broke, or could not open (the scheduler died and is being restarted
on its address), is tried again the same way for a bounded wait (`route`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.proto.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2_grpc,
)
from meshserve.services.gateway.links.detokenize import DetokenizeStream, TokenLookup
from meshserve.services.gateway.links.route_link import RouteStream
from meshserve.services.gateway.links.worker_link import WorkerLink
from meshserve.shared.errors import MeshError, UnavailableError
from meshserve.shared.grpc_client import GrpcClient, mesh_errors

TOKENIZER_SERVICE = "meshserve.v1.Tokenizer"
# A replica whose stream broke is passed over for this long while another one is fine.
_REPLICA_COOLDOWN_S = 5.0
# Detokenizer failover: a health check's deadline, and the pause between rounds of them
# (doubling from the first value up to the second).
_PROBE_TIMEOUT_S = 1.0
_PROBE_PAUSE_S = (0.05, 1.0)
# How long calls on a replaced tokenizer channel may still run before they are cancelled.
_OLD_CHANNEL_GRACE_S = 5.0
SCHEDULER_SERVICE = "meshserve.v1.Scheduler"
_T = TypeVar("_T")


@dataclass(frozen=True)
class WorkerEntry:
    """What the gateway needs to know about one registered worker."""

    worker_id: str
    model_names: tuple[str, ...]
    max_model_len: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # generation config
    metrics_url: str = ""  # its Prometheus /metrics ("": none)
    address: str = ""
    loras: tuple[LoraEntry, ...] = ()  # the LoRA adapters it serves
    generates: bool = True  # a generation worker (not a pooling one)
    class_labels: tuple[str, ...] = ()  # a pooling sequence classifier's (empty: embeddings)

    def serves(self, model: str) -> bool:
        """Whether requests for `model` (a model name or a LoRA adapter's) can run here."""
        return model in self.model_names or any(a.name == model for a in self.loras)


@dataclass(frozen=True)
class LoraEntry:
    """A LoRA adapter a worker serves: requests name it as their model."""

    name: str
    lora_id: int
    base_model: str  # the model it adapts (its parent in /v1/models)


@dataclass(frozen=True)
class HealthReport:
    """Readiness of what the gateway depends on (GET /health)."""

    scheduler_serving: bool
    tokenizers_serving: dict[str, bool]
    num_workers: int
    redis_lost: bool = False  # the scheduler places by load only until Redis is back

    @property
    def ok(self) -> bool:
        return (self.scheduler_serving and any(self.tokenizers_serving.values())
                and self.num_workers > 0)

    @property
    def status(self) -> str:
        """ok; degraded (serving, but without a tokenizer replica or Redis); unavailable."""
        if not self.ok:
            return "unavailable"
        if self.redis_lost or not all(self.tokenizers_serving.values()):
            return "degraded"
        return "ok"

    def as_dict(self) -> dict[str, object]:
        report: dict[str, object] = {
            "status": self.status, "scheduler": self.scheduler_serving,
            "tokenizers": self.tokenizers_serving, "workers": self.num_workers}
        if self.redis_lost:
            report["degraded"] = ("Redis is unreachable: requests are placed by load only, "
                                  "without prefix-cache matches")
        return report


class MeshClients:
    """Stubs of the services behind the gateway, with cached channels."""

    def __init__(self, tokenizer_addresses: Sequence[str], scheduler_address: str, *,
                 client: GrpcClient | None = None, model_cache_ttl_s: float = 5.0) -> None:
        assert tokenizer_addresses, "at least one tokenizer address is needed"
        self._client = client or GrpcClient()
        self._tokenizer_channels = [self._client.channel(a) for a in tokenizer_addresses]
        self.tokenizer_addresses = tuple(tokenizer_addresses)
        self._tokenizers = [tokenizer_pb2_grpc.TokenizerStub(c) for c in self._tokenizer_channels]
        self._next_tokenizer = 0
        self.scheduler_address = scheduler_address
        self._scheduler_channel = self._client.channel(scheduler_address)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._workers: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._closing: set[asyncio.Future[None]] = set()  # channels of broken sessions
        self._worker_cache: tuple[float, list[WorkerEntry]] | None = None
        self._models_listed: dict[str, float] = {}  # model -> when a list last named it
        self._cache_ttl_s = model_cache_ttl_s
        self._worker_refresh: asyncio.Future[list[WorkerEntry]] | None = None
        self._worker_links: dict[str, WorkerLink] = {}
        self._routes: RouteStream | None = None
        self._detok_streams: list[DetokenizeStream | None] = [None] * len(self._tokenizers)
        self._detok_failed_at = [float("-inf")] * len(self._tokenizers)
        self._next_detok = 0
        self._token_lookup = TokenLookup()  # every replica serves the same tokenizer
        self._detok_recovery: asyncio.Future[DetokenizeStream] | None = None

    # -- stubs ------------------------------------------------------------------------------

    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerStub:
        """The next tokenizer replica (round-robin)."""
        stub = self._tokenizers[self._next_tokenizer % len(self._tokenizers)]
        self._next_tokenizer += 1
        return stub

    async def call_tokenizer(self, call: Callable[[tokenizer_pb2_grpc.TokenizerStub],
                                                  Awaitable[_T]]) -> _T:
        """Run an idempotent unary call on one replica, trying each other one (in turn from
        the next) while unavailable."""
        count = len(self._tokenizers)
        first = self._next_tokenizer
        self._next_tokenizer += 1
        last: MeshError | None = None
        for k in range(count):
            try:
                with mesh_errors():
                    return await call(self._tokenizers[(first + k) % count])
            except UnavailableError as exc:
                last = exc
        assert last is not None
        raise last

    async def tokenizer_info(self, timeout_s: float) -> str:
        """The served tokenizer's configuration (vLLM's /tokenizer_info) as a JSON object's
        text, from a replica (kept as text: it may hold integers past 64 bits, such as a
        tokenizer's "no limit" model_max_length)."""
        request = tokenizer_pb2.TokenizerInfoRequest()
        response = await self.call_tokenizer(
            lambda stub: stub.GetTokenizerInfo(request, timeout=timeout_s))
        return response.info_json

    def worker(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """The Worker stub of `address` (host:port), its channel opened once and cached."""
        entry = self._workers.get(address)
        if entry is None:
            channel = self._client.channel(address)
            entry = (channel, worker_pb2_grpc.WorkerStub(channel))
            self._workers[address] = entry
        return entry[1]

    # -- data plane -------------------------------------------------------------------------

    def route_stream(self) -> RouteStream:
        """This gateway's RouteSession stream to the scheduler (opened on first use)."""
        if self._routes is None or not self._routes.usable:
            self._routes = RouteStream(self.scheduler)
        return self._routes

    async def route(self, request: scheduler_pb2.RouteRequest, *, traceparent: str,
                    timeout_s: float, wait_s: float) -> scheduler_pb2.RouteResponse:
        """The scheduler's route for one request, within `timeout_s`. While the scheduler
        cannot be reached (the RouteSession stream broke or would not open), the route is
        tried again on a fresh channel after a growing pause, for at most `wait_s`; then
        the stream's UnavailableError is raised. An error the scheduler answered (no
        worker, overloaded, ...) is raised at once."""
        now = time.monotonic()
        deadline, give_up = now + timeout_s, now + wait_s
        pause, _ = _PROBE_PAUSE_S
        while True:
            stream = self.route_stream()
            try:
                return await stream.route(request, traceparent=traceparent,
                                          timeout_s=max(deadline - time.monotonic(), 0.0))
            except UnavailableError:
                if stream.usable or time.monotonic() + pause > min(deadline, give_up):
                    raise
            # A restarted scheduler is reached at once on a fresh channel, where the old one
            # may wait out its reconnect backoff; the first request to see the stream break
            # opens it for all.
            if self._routes is stream:
                self._renew_scheduler_channel()
            await asyncio.sleep(pause)  # the scheduler gives no signal when it is back
            pause = min(pause * 2, _PROBE_PAUSE_S[1])

    def _renew_scheduler_channel(self) -> None:
        old = self._scheduler_channel
        self._scheduler_channel = self._client.channel(self.scheduler_address)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._routes = None
        task = asyncio.ensure_future(old.close(grace=_OLD_CHANNEL_GRACE_S))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def worker_link(self, address: str) -> WorkerLink:
        """This gateway's Session stream to the worker at `address` (opened on first use)."""
        link = self._worker_links.get(address)
        if link is not None and not link.usable:
            # The stream broke, so the worker may have restarted on this address: a fresh
            # channel connects at once, where the old one may still wait out a reconnect
            # backoff and fail the new stream with UNAVAILABLE.
            self._drop_worker_channel(address)
            link = None
        if link is None:
            link = self._worker_links[address] = WorkerLink(self.worker(address), address)
        return link

    def _drop_worker_channel(self, address: str) -> None:
        entry = self._workers.pop(address, None)
        if entry is not None:
            task = asyncio.ensure_future(entry[0].close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def detokenize_stream(self) -> DetokenizeStream:
        """The DetokenizeSession stream of the next tokenizer replica (round-robin), passing
        over replicas whose stream broke in the last few seconds while others are fine."""
        count = len(self._tokenizers)
        now = time.monotonic()
        for _ in range(count):
            i = self._next_detok % count
            self._next_detok += 1
            stream = self._usable_detokenize_stream(i)
            if stream is not None:
                return stream
            if now - self._detok_failed_at[i] >= _REPLICA_COOLDOWN_S:
                break
        return self._open_detokenize_stream(i)

    def _usable_detokenize_stream(self, i: int) -> DetokenizeStream | None:
        """Replica `i`'s stream unless it broke; a broken one is dropped, with the replica's
        channel (the replica may come back on its address: see _renew_tokenizer_channel)."""
        stream = self._detok_streams[i]
        if stream is not None and not stream.usable:
            self._detok_failed_at[i] = time.monotonic()
            stream = self._detok_streams[i] = None
            self._renew_tokenizer_channel(i)
        return stream

    def _open_detokenize_stream(self, i: int) -> DetokenizeStream:
        stream = DetokenizeStream(self._tokenizers[i], self.tokenizer_addresses[i],
                                  self._token_lookup)
        self._detok_streams[i] = stream
        return stream

    async def recover_detokenize_stream(self, wait_s: float) -> DetokenizeStream:
        """A stream for requests whose DetokenizeSession broke: an open one, or a new one to
        the first replica found SERVING, probing every replica each round for up to `wait_s`
        (callers arriving during a search share it). UnavailableError if none came back."""
        if self._detok_recovery is None or self._detok_recovery.done():
            self._detok_recovery = asyncio.ensure_future(self._find_detokenizer(wait_s))
        # shield: one caller going away must not cancel the others' shared search.
        return await asyncio.shield(self._detok_recovery)

    async def _find_detokenizer(self, wait_s: float) -> DetokenizeStream:
        deadline = time.monotonic() + wait_s
        pause, max_pause = _PROBE_PAUSE_S
        while True:
            stream = await self._serving_detokenizer()
            if stream is not None:
                return stream
            left = deadline - time.monotonic()
            if left <= 0:
                raise UnavailableError(
                    f"no tokenizer replica answered for {wait_s:g}s to take over the "
                    f"detokenization (tried {', '.join(self.tokenizer_addresses)})")
            await asyncio.sleep(min(pause, left))  # backoff: a replica's start sends no signal
            pause = min(pause * 2, max_pause)

    async def _serving_detokenizer(self) -> DetokenizeStream | None:
        """One round of the search: the next replica with an open stream or SERVING."""
        count = len(self._tokenizers)
        for _ in range(count):
            i = self._next_detok % count
            self._next_detok += 1
            stream = self._usable_detokenize_stream(i)
            if stream is not None:
                return stream
            if await _serving(self._tokenizer_channels[i], TOKENIZER_SERVICE, _PROBE_TIMEOUT_S):
                return self._open_detokenize_stream(i)
            self._renew_tokenizer_channel(i)
        return None

    def _renew_tokenizer_channel(self, i: int) -> None:
        """A fresh channel for replica `i`: it connects at once on next use, where the old
        one may still wait out a reconnect backoff after the replica restarted. Calls still
        running on the old one get a grace period to finish."""
        old = self._tokenizer_channels[i]
        channel = self._tokenizer_channels[i] = self._client.channel(self.tokenizer_addresses[i])
        self._tokenizers[i] = tokenizer_pb2_grpc.TokenizerStub(channel)
        task = asyncio.ensure_future(old.close(grace=_OLD_CHANNEL_GRACE_S))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- registry ---------------------------------------------------------------------------

    async def list_workers(self, *, refresh: bool = False) -> list[WorkerEntry]:
        """Registered workers, cached for the configured TTL (past it too while the
        scheduler cannot be reached).

        Concurrent callers share one ListWorkers call: a burst of a thousand requests
        arriving as the cache expires costs the scheduler one call, not a thousand.
        """
        now = time.monotonic()
        if not refresh and self._worker_cache and now - self._worker_cache[0] < self._cache_ttl_s:
            return self._worker_cache[1]
        if self._worker_refresh is None or self._worker_refresh.done():
            self._worker_refresh = asyncio.ensure_future(self._fetch_workers())
        try:
            # shield: one caller going away must not cancel the others' shared call.
            return await asyncio.shield(self._worker_refresh)
        except UnavailableError:
            if self._worker_cache is None:
                raise
            # The scheduler is away (restarting): the last list stands until it is back.
            return self._worker_cache[1]

    async def _fetch_workers(self) -> list[WorkerEntry]:
        with mesh_errors():
            response = await self.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest())
        workers = [WorkerEntry(w.info.worker_id, tuple(w.info.model_names), w.info.max_model_len,
                               _defaults(w.info.sampling_defaults_json), w.info.metrics_url,
                               w.info.address,
                               tuple(LoraEntry(a.name, a.id, a.base_model_name)
                                     for a in w.info.loras),
                               w.info.runner != common_pb2.RUNNER_POOLING,
                               tuple(w.info.class_labels))
                   for w in response.workers]
        now = time.monotonic()
        self._worker_cache = (now, workers)
        for worker in workers:
            self._models_listed.update(dict.fromkeys(worker.model_names, now))
        return workers

    def listed_within(self, model: str, seconds: float) -> bool:
        """Whether a worker list fetched less than `seconds` ago named `model` (a scheduler
        restarted, or Redis come back empty, lists none until the workers register again)."""
        listed = self._models_listed.get(model)
        return listed is not None and time.monotonic() - listed < seconds

    async def model_names(self, *, refresh: bool = False) -> list[str]:
        """Model names the registered workers serve, first seen first."""
        names: dict[str, None] = {}
        for worker in await self.list_workers(refresh=refresh):
            names.update(dict.fromkeys(worker.model_names))
        return list(names)

    async def lora_adapters(self, *, refresh: bool = False) -> dict[str, LoraEntry]:
        """The LoRA adapters the registered workers serve, by name, first seen first."""
        adapters: dict[str, LoraEntry] = {}
        for worker in await self.list_workers(refresh=refresh):
            for adapter in worker.loras:
                adapters.setdefault(adapter.name, adapter)
        return adapters

    async def sampling_defaults(self, model: str) -> dict[str, Any]:
        """Defaults for the request fields a body leaves out, as `model`'s workers announce
        them (its generation config; empty when none or unknown)."""
        try:
            workers = await self.list_workers()
        except MeshError:
            return {}
        return next((w.sampling_defaults for w in workers if w.serves(model)), {})

    async def max_model_len(self, model: str) -> int | None:
        """Context length of `model` as its workers announce it (None when unknown)."""
        try:
            workers = await self.list_workers()
        except MeshError:
            return None  # only an early check; the worker validates the request again
        lengths = [w.max_model_len for w in workers if w.serves(model) and w.max_model_len]
        return min(lengths) if lengths else None

    # -- health -----------------------------------------------------------------------------

    async def health(self, timeout_s: float) -> HealthReport:
        """Check the scheduler, every tokenizer replica and the worker registry at once."""
        checks = [_serving(self._scheduler_channel, SCHEDULER_SERVICE, timeout_s)]
        checks += [_serving(c, TOKENIZER_SERVICE, timeout_s) for c in self._tokenizer_channels]
        serving, (num_workers, redis_lost) = await asyncio.gather(
            asyncio.gather(*checks), self._count_workers(timeout_s))
        scheduler, *tokenizers = serving
        return HealthReport(bool(scheduler),
                            dict(zip(self.tokenizer_addresses, map(bool, tokenizers),
                                     strict=True)),
                            num_workers, redis_lost)

    async def _count_workers(self, timeout_s: float) -> tuple[int, bool]:
        """Registered workers, and whether the scheduler has lost Redis."""
        try:
            response = await self.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(),
                                                        timeout=timeout_s)
        except grpc.RpcError:
            return 0, False
        return len(response.workers), response.degraded

    async def close(self) -> None:
        """Close every channel (in-flight calls are cancelled)."""
        if self._detok_recovery is not None:
            self._detok_recovery.cancel()
        streams: list[WorkerLink | DetokenizeStream | RouteStream] = [
            *self._worker_links.values(), *(s for s in self._detok_streams if s),
            *([self._routes] if self._routes is not None else [])]
        await asyncio.gather(*(s.aclose() for s in streams))
        self._worker_links.clear()
        channels = [*self._tokenizer_channels, self._scheduler_channel,
                    *(c for c, _ in self._workers.values())]
        self._workers.clear()
        await asyncio.gather(*(c.close() for c in channels), *self._closing)


async def _serving(channel: grpc.aio.Channel, service: str, timeout_s: float) -> bool:
    """Whether the health service of `channel` says `service` is SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def _defaults(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        logging.getLogger(__name__).warning("a worker announced sampling defaults that are not JSON: %.200s", text)
        return {}
    return value if isinstance(value, dict) else {}
