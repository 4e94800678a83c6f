"""Channels to meshserve services, and gRPC errors turned back into MeshError.

    client = GrpcClient()
    channel = client.channel("127.0.0.1:50053")
    stub = worker_pb2_grpc.WorkerStub(channel)
    with mesh_errors():
        response = await stub.GetLoad(request, timeout=remaining_s)

Every channel has keepalive, the mesh's message size limit, trace-context
propagation, and a gRPC service config that gives every method a default deadline
(`METHOD_TIMEOUTS_S`; a shorter `timeout=` on the call wins) and retries calls that
failed with UNAVAILABLE, but only for the idempotent methods in `IDEMPOTENT_METHODS`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.shared.errors import DeadlineExceededError, MeshError, UnavailableError
from meshserve.shared.status import error_from_status
from meshserve.shared.telemetry import trace_context_interceptors

# KV blocks of large models are several MiB each; a Put or Get message may hold a few.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

METHOD_TIMEOUTS_S: Mapping[str, float] = MappingProxyType({
    # Default for every method not named below: unary control calls.
    "": 10.0,
    # The data plane's session streams last as long as the gateway (about 30 years);
    # keepalive pings find a dead peer, each request has its own deadline inside.
    "meshserve.v1.Worker/Session": 1e9,
    "meshserve.v1.Tokenizer/DetokenizeSession": 1e9,
    "meshserve.v1.Scheduler/RouteSession": 1e9,
    # Bulk KV transfers.
    "meshserve.v1.KVStore/Put": 120.0,
    "meshserve.v1.KVStore/Get": 120.0,
    # A batch of images through a vision tower.
    "meshserve.v1.Encoder/Encode": 60.0,
    "grpc.health.v1.Health/Watch": 86400.0,
})
"""Default deadline of each method ("service/method"; "" for all others), in seconds."""

IDEMPOTENT_METHODS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "meshserve.v1.Tokenizer": ("Tokenize", "CountTokens"),
    # Registration is keyed by (worker_id, epoch), heartbeats carry absolute load.
    "meshserve.v1.Scheduler": ("RegisterWorker", "Heartbeat", "DeregisterWorker",
                               "ListWorkers"),
    "meshserve.v1.Worker": ("Abort", "GetLoad", "GetInfo"),
    "meshserve.v1.KVStore": ("Get", "Contains", "Stats"),
    "meshserve.v1.Encoder": ("Encode",),
    "grpc.health.v1.Health": ("Check", "List"),
})
"""Methods retried on UNAVAILABLE. Not the session streams or Put: a retry could run a
request twice or lose stream state, so their callers decide (e.g. re-route)."""


def _duration(seconds: float) -> str:
    """A protobuf JSON Duration ("0.1s")."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


@dataclass(frozen=True)
class GrpcClient:
    """How meshserve opens channels: keepalive, limits, deadlines, retries, tracing."""

    method_timeouts_s: Mapping[str, float] = field(default_factory=lambda: METHOD_TIMEOUTS_S)
    idempotent_methods: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: IDEMPOTENT_METHODS)
    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # A peer that restarts is found again within this many seconds (gRPC's own cap is 120).
    max_reconnect_backoff_s: float = 5.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        assert "" in self.method_timeouts_s, "method_timeouts_s needs a default entry ''"
        assert 2 <= self.max_attempts <= 5, f"max_attempts must be in [2, 5]: {self.max_attempts}"

    def _method_config(self, service: str, method: str) -> dict[str, Any]:
        key = f"{service}/{method}" if service else ""
        timeout = self.method_timeouts_s.get(key, self.method_timeouts_s[""])
        name = {"service": service, "method": method} if service else {}
        config: dict[str, Any] = {"name": [name], "timeout": _duration(timeout)}
        if method in self.idempotent_methods.get(service, ()):
            config["retryPolicy"] = {
                "maxAttempts": self.max_attempts,
                "initialBackoff": _duration(self.initial_backoff_s),
                "maxBackoff": _duration(self.max_backoff_s),
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            }
        return config

    def service_config(self) -> dict[str, Any]:
        """The gRPC service config: a deadline for every method, retries for idempotent ones."""
        # gRPC applies only the most specific entry to a method, so every method that is
        # named gets its timeout and its retry policy in one entry.
        named = {tuple(key.split("/", 1)) for key in self.method_timeouts_s if key}
        named |= {(service, method) for service, methods in self.idempotent_methods.items()
                  for method in methods}
        configs = [self._method_config("", "")]
        configs += [self._method_config(service, method) for service, method in sorted(named)]
        # Round-robin over every address a name resolves to, so that replicas scaled behind
        # one DNS name (compose `--scale tokenizer=M`) all get calls.
        return {"methodConfig": configs, "loadBalancingConfig": [{"round_robin": {}}]}

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel arguments: keepalive, reconnects, message limits, retries, service config."""
        return [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.enable_retries", 1),
            # Each channel owns its connections. With gRPC's process-wide pool, a new channel
            # to a peer restarted on the same address shares the connection of an older
            # channel still waiting out its reconnect backoff, and fails with "connection
            # refused" although the peer is listening.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_reconnect_backoff_ms", int(self.max_reconnect_backoff_s * 1000)),
            ("grpc.service_config", json.dumps(self.service_config())),
        ]

    def channel(self, target: str, *,
                interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
        """An insecure grpc.aio channel to `target` (host:port) with trace propagation."""
        return grpc.aio.insecure_channel(
            target, options=self.channel_options(),
            interceptors=[*trace_context_interceptors(), *interceptors])


def error_from_rpc(error: grpc.RpcError) -> MeshError:
    """The MeshError a failed call stands for (the server's own class when it sent one)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return error_from_status(code, details, metadata)


@contextmanager
def mesh_errors() -> Iterator[None]:
    """Turn gRPC errors raised in the block (awaiting a call, reading a stream) into MeshError."""
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from exc


async def wait_until_serving(channel: grpc.aio.Channel, service: str = "",
                             timeout_s: float = 30.0) -> None:
    """Return once the server's health for `service` is SERVING (watches; no polling).

    Raises UnavailableError if the watch ends (the server stopped) first, and
    DeadlineExceededError after `timeout_s`.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        async for response in stub.Watch(request, timeout=timeout_s, wait_for_ready=True):
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise DeadlineExceededError(
                f"{service or 'server'} not SERVING after {timeout_s}s", param="timeout_s"
            ) from exc
        raise error_from_rpc(exc) from exc
    raise UnavailableError(f"health watch of {service or 'server'} ended before SERVING")
