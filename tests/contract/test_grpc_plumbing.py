"""Contract tests of the shared gRPC plumbing on a real grpc.aio server on 127.0.0.1.

A tiny fake Worker servicer, built from worker.proto, stands in for the engine.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from meshserve.proto.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from meshserve.shared import errors
from meshserve.shared.grpc_client import GrpcClient, mesh_errors, wait_until_serving
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.logs import JsonFormatter, TraceContextFilter, setup_logging
from meshserve.shared.telemetry import Telemetry

_C = grpc.StatusCode
WORKER = "meshserve.v1.Worker"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# The status each error class must travel as (the mapping the design fixes).
EXPECTED_CODES = [
    (errors.InvalidRequestError, _C.INVALID_ARGUMENT),
    (errors.ContextLengthError, _C.INVALID_ARGUMENT),
    (errors.NotFoundError, _C.NOT_FOUND),
    (errors.OverloadedError, _C.RESOURCE_EXHAUSTED),
    (errors.UnavailableError, _C.UNAVAILABLE),
    (errors.AuthenticationError, _C.UNAUTHENTICATED),
    (errors.DeadlineExceededError, _C.DEADLINE_EXCEEDED),
    (errors.InternalError, _C.INTERNAL),
    (errors.ModelLoadError, _C.INTERNAL),
]


def _step(handle: int, tokens: list[list[int]], finished: bool = False
          ) -> worker_pb2.SessionResponse:
    """One Session message: sequence i of `handle` gets tokens[i]."""
    reason = common_pb2.FINISH_REASON_STOP if finished else common_pb2.FINISH_REASON_UNSPECIFIED
    return worker_pb2.SessionResponse(
        handles=[handle] * len(tokens), indices=list(range(len(tokens))),
        num_tokens=[len(t) for t in tokens], token_ids=[t for seq in tokens for t in seq],
        finish_reasons=[reason] * len(tokens))


def _entries(response: worker_pb2.SessionResponse) -> list[list[int]]:
    """The tokens of each entry of a Session message."""
    entries, position = [], 0
    for size in response.num_tokens:
        entries.append(list(response.token_ids[position:position + size]))
        position += size
    return entries


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Session streams that behave according to the request id of each add (a add with
    no request is answered with its handle at once); records what it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: dict[str, int] = {}
        self.fail_next_get_load: type[errors.MeshError] | None = None
        self.log = logging.getLogger("fake_worker")

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            for add in request.adds:
                if not add.HasField("request"):
                    yield worker_pb2.SessionResponse(handles=[add.handle])
                    continue
                async for response in self._run(add.handle, add.request.request_id):
                    yield response

    async def _run(self, handle: int, rid: str) -> AsyncIterator[worker_pb2.SessionResponse]:
        """Two messages of two sequences; an error (which ends the stream), or a wait for
        `release` before the second, as the request id says."""
        self.calls[rid] = self.calls.get(rid, 0) + 1
        self.log.info("generating", extra={"request_id": rid})
        if rid.startswith("raise:"):
            cls = errors.error_class_for_kind(rid.split(":", 1)[1])
            raise cls(f"bad value for {rid}", param="top_p")
        if rid == "bug":
            raise ValueError("division by zero somewhere")
        yield _step(handle, [[1, 2, 3], [4]])
        if rid == "fail-midway":
            raise errors.OverloadedError("preempted for good", param=None)
        if rid == "block":
            await self.release.wait()
        yield _step(handle, [[5], [6]], finished=True)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        self.calls["GetLoad"] = self.calls.get("GetLoad", 0) + 1
        if self.fail_next_get_load is not None:
            cls, self.fail_next_get_load = self.fail_next_get_load, None
            raise cls("not yet", param="load")
        return worker_pb2.GetLoadResponse(load=common_pb2.WorkerLoad(worker_id="w0", num_running=2))


class FakeKVStore(kvstore_pb2_grpc.KVStoreServicer):
    """A server-streaming call (the mesh's other stream shape): Get answers one message."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log

    async def Get(self, request: kvstore_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[kvstore_pb2.GetResponse]:
        self.log.info("getting", extra={"kv_namespace": request.kv_namespace})
        yield kvstore_pb2.GetResponse()


@dataclass
class Harness:
    """A started server with the fake worker (and kvstore), and a client channel to it."""

    server: GrpcServer
    servicer: FakeWorker
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    port: int
    telemetry: Telemetry
    exporter: InMemorySpanExporter


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("fake-worker", span_exporter=exporter)
    server = GrpcServer("127.0.0.1:0", service_names=[WORKER], telemetry=telemetry, grace_s=10)
    servicer = FakeWorker()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(FakeKVStore(servicer.log), server.server)
    port = await server.start()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    yield Harness(server, servicer, channel, worker_pb2_grpc.WorkerStub(channel), port,
                  telemetry, exporter)
    await channel.close()
    if not server.drain_started.is_set():
        await server.drain(grace_s=0)


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


def _adding(rid: str) -> worker_pb2.SessionRequest:
    return worker_pb2.SessionRequest(adds=[worker_pb2.SessionAdd(
        handle=1, request=worker_pb2.GenerateRequest(
            request_id=rid, prompts=[worker_pb2.Prompt(token_ids=[7])]))])


async def _generate(stub: Any, rid: str, **kwargs: Any) -> list[worker_pb2.SessionResponse]:
    """Run one request on a Session stream (half-closed after the add) to its end."""
    return [response async for response in stub.Session(iter([_adding(rid)]), **kwargs)]


async def test_health_is_not_serving_until_warm(harness: Harness) -> None:
    assert await _health(harness.channel) == NOT_SERVING
    assert await _health(harness.channel, WORKER) == NOT_SERVING
    waiter = asyncio.ensure_future(wait_until_serving(harness.channel, WORKER, timeout_s=10))
    await harness.server.set_serving()
    await waiter
    assert await _health(harness.channel) == SERVING
    assert await _health(harness.channel, WORKER) == SERVING
    listed = await health_pb2_grpc.HealthStub(harness.channel).List(health_pb2.HealthListRequest())
    assert {name: s.status for name, s in listed.statuses.items()} == {"": SERVING,
                                                                      WORKER: SERVING}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _health(harness.channel, "meshserve.v1.Nothing")
    assert info.value.code() == _C.NOT_FOUND


async def test_a_taken_port_is_an_error_not_a_shared_socket(harness: Harness) -> None:
    second = GrpcServer(f"127.0.0.1:{harness.port}", service_names=[WORKER])
    with pytest.raises(errors.UnavailableError, match="cannot listen") as info:
        await second.start()
    assert info.value.param == "address"


async def test_a_new_channel_reaches_a_peer_restarted_on_the_same_port(
        harness: Harness) -> None:
    # The harness's channel saw the peer go away and waits out its reconnect backoff;
    # a channel opened after the restart must not inherit that wait.
    await harness.server.set_serving()
    assert await _health(harness.channel) == SERVING
    await harness.server.drain(grace_s=0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _health(harness.channel)
    assert info.value.code() == _C.UNAVAILABLE
    restarted = GrpcServer(f"127.0.0.1:{harness.port}", service_names=[WORKER])
    await restarted.start()
    await restarted.set_serving()
    channel = GrpcClient().channel(f"127.0.0.1:{harness.port}")
    try:
        assert await _health(channel) == SERVING
    finally:
        await channel.close()
        await restarted.drain(grace_s=0)


async def _get(channel: grpc.aio.Channel) -> list[kvstore_pb2.GetResponse]:
    """A server-streaming call: the fake kvstore's Get."""
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    return [r async for r in stub.Get(kvstore_pb2.GetRequest(kv_namespace="ns"))]


async def test_stream_carries_every_message(harness: Harness) -> None:
    responses = await _generate(harness.stub, "ok")
    assert [_entries(r) for r in responses] == [[[1, 2, 3], [4]], [[5], [6]]]
    assert responses[-1].finish_reasons[0] == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(("cls", "code"), EXPECTED_CODES, ids=lambda v: getattr(v, "__name__", ""))
async def test_mesh_error_arrives_as_status_and_converts_back(
        harness: Harness, cls: type[errors.MeshError], code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await _generate(harness.stub, f"raise:{cls.kind}")
    assert raw.value.code() == code
    assert raw.value.details() == f"bad value for raise:{cls.kind}"
    with pytest.raises(errors.MeshError) as converted, mesh_errors():
        await _generate(harness.stub, f"raise:{cls.kind}")
    assert type(converted.value) is cls
    assert converted.value.message == f"bad value for raise:{cls.kind}"
    assert converted.value.param == "top_p"


async def test_error_after_some_messages_keeps_them(harness: Harness) -> None:
    received = []
    with pytest.raises(errors.OverloadedError, match="preempted for good"), mesh_errors():
        async for response in harness.stub.Session(iter([_adding("fail-midway")])):
            received.append(response)
    assert len(received) == 1


async def test_unexpected_exception_is_internal_and_logged(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="meshserve.shared.grpc_server"), \
            pytest.raises(errors.InternalError, match="ValueError") as info, mesh_errors():
        await _generate(harness.stub, "bug")
    assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
    assert info.value.__cause__.code() == _C.INTERNAL
    records = [r for r in caplog.records if r.exc_info and r.exc_info[0] is ValueError]
    assert records, "the traceback of an unexpected exception must be logged"


async def test_idempotent_method_is_retried_on_unavailable(harness: Harness) -> None:
    harness.servicer.fail_next_get_load = errors.UnavailableError
    response = await harness.stub.GetLoad(worker_pb2.GetLoadRequest())
    assert response.load.num_running == 2
    assert harness.servicer.calls["GetLoad"] == 2


async def test_non_idempotent_method_is_not_retried(harness: Harness) -> None:
    with pytest.raises(errors.UnavailableError), mesh_errors():
        await _generate(harness.stub, "raise:unavailable")
    assert harness.servicer.calls["raise:unavailable"] == 1


async def test_every_call_gets_a_default_deadline(harness: Harness) -> None:
    client = GrpcClient(method_timeouts_s={"": 0.2})
    async with client.channel(f"127.0.0.1:{harness.port}") as channel:
        with pytest.raises(errors.DeadlineExceededError), mesh_errors():
            await _generate(worker_pb2_grpc.WorkerStub(channel), "block")  # no timeout= given


async def test_drain_finishes_in_flight_streams_and_refuses_new_calls(harness: Harness) -> None:
    await harness.server.set_serving()
    health = health_pb2_grpc.HealthStub(harness.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=WORKER))
    assert (await watch.read()).status == SERVING

    call = harness.stub.Session(iter([_adding("block")]))
    first = await call.read()
    assert _entries(first) == [[1, 2, 3], [4]]

    waiter = asyncio.ensure_future(harness.server.wait_for_termination())
    harness.server.request_stop()
    await harness.server.drain_started.wait()
    assert (await watch.read()).status == NOT_SERVING
    assert await watch.read() is grpc.aio.EOF  # watchers do not hold up the drain

    with pytest.raises(errors.UnavailableError), mesh_errors():
        await _generate(harness.stub, "ok")
    harness.servicer.release.set()
    last = await call.read()
    assert _entries(last) == [[5], [6]]
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == _C.OK
    await asyncio.wait_for(waiter, timeout=5)  # well within the 10 s grace


async def test_drain_cancels_calls_still_running_after_grace(harness: Harness) -> None:
    call = harness.stub.Session(iter([_adding("block")]))
    await call.read()
    await asyncio.wait_for(harness.server.drain(grace_s=0.1), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() in (_C.CANCELLED, _C.UNAVAILABLE)


async def test_sigterm_starts_the_drain(harness: Harness) -> None:
    harness.server.install_signal_handlers()
    waiter = asyncio.ensure_future(harness.server.wait_for_termination())
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(waiter, timeout=5)
    assert harness.server.draining
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


@pytest.mark.parametrize("method", ["Worker/GetLoad", "KVStore/Get"])
async def test_traceparent_from_the_client_parents_the_server_span(harness: Harness,
                                                                   method: str) -> None:
    client_exporter = InMemorySpanExporter()
    client_telemetry = Telemetry("fake-gateway", span_exporter=client_exporter)
    with client_telemetry.tracer.start_as_current_span("gateway request") as parent:
        if method == "Worker/GetLoad":  # unary
            await harness.stub.GetLoad(worker_pb2.GetLoadRequest())
        else:  # server stream
            await _get(harness.channel)
    server_spans = [s for s in harness.exporter.get_finished_spans()
                    if s.name == f"meshserve.v1.{method}"]
    assert len(server_spans) == 1
    span = server_spans[0]
    assert span.kind == SpanKind.SERVER
    assert span.parent is not None
    assert span.parent.span_id == parent.get_span_context().span_id
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.attributes["rpc.method"] == method.split("/")[1]
    assert span.resource.attributes["service.name"] == "fake-worker"


async def test_failed_call_marks_its_span_and_metrics(harness: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError):
        await _generate(harness.stub, "raise:overloaded")
    span = next(s for s in harness.exporter.get_finished_spans()
                if s.name == f"{WORKER}/Session")
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["rpc.grpc.status_code"] == _C.RESOURCE_EXHAUSTED.value[0]
    runner = await harness.telemetry.start_metrics_server("127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/metrics") as response:
            text = await response.text()
    finally:
        await runner.cleanup()
    assert ('meshserve:rpc_server_duration_seconds_count{code="RESOURCE_EXHAUSTED",'
            'method="/meshserve.v1.Worker/Session"} 1.0') in text


async def test_log_records_carry_the_trace_of_the_call(harness: Harness) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter("fake-worker"))
    harness.servicer.log.addHandler(handler)
    harness.servicer.log.setLevel(logging.INFO)
    try:
        client_telemetry = Telemetry("fake-gateway", span_exporter=InMemorySpanExporter())
        with client_telemetry.tracer.start_as_current_span("gateway request") as parent:
            await _get(harness.channel)
    finally:
        harness.servicer.log.removeHandler(handler)
    record = orjson.loads(stream.getvalue().splitlines()[0])
    assert record["message"] == "getting"
    assert record["kv_namespace"] == "ns"
    assert record["service"] == "fake-worker"
    assert record["trace_id"] == format(parent.get_span_context().trace_id, "032x")
    server_span = next(s for s in harness.exporter.get_finished_spans()
                       if s.name == "meshserve.v1.KVStore/Get")
    assert record["span_id"] == format(server_span.context.span_id, "016x")


def test_setup_logging_writes_json_lines_and_replaces_itself() -> None:
    root = logging.getLogger()
    level, first_stream, stream = root.level, io.StringIO(), io.StringIO()
    try:
        first = setup_logging("svc", "INFO", stream=first_stream)
        second = setup_logging("svc", "DEBUG", stream=stream)
        assert first not in root.handlers and second in root.handlers
        try:
            raise KeyError("missing")
        except KeyError:
            logging.getLogger("meshserve.test").debug("lookup failed", exc_info=True,
                                                      extra={"block": 3})
    finally:
        root.removeHandler(second)
        root.setLevel(level)
    assert first_stream.getvalue() == ""
    record = orjson.loads(stream.getvalue())
    assert (record["level"], record["logger"], record["block"]) == ("DEBUG", "meshserve.test", 3)
    assert (record["trace_id"], record["span_id"]) == ("", "")
    assert "KeyError: 'missing'" in record["exception"]


def test_session_streams_outlive_any_request_deadline() -> None:
    # The data plane's bidirectional streams live as long as their gateway: a default
    # unary deadline would cut them (and every request on them) after seconds.
    from meshserve.proto.v1 import scheduler_pb2, tokenizer_pb2, worker_pb2
    from meshserve.shared.grpc_client import METHOD_TIMEOUTS_S

    sessions = [f"{service.full_name}/{method.name}"
                for module in (scheduler_pb2, tokenizer_pb2, worker_pb2)
                for service in module.DESCRIPTOR.services_by_name.values()
                for method in service.methods
                if method.client_streaming and method.server_streaming
                and method.name.endswith("Session")]
    assert sorted(sessions) == ["meshserve.v1.Scheduler/RouteSession",
                                "meshserve.v1.Tokenizer/DetokenizeSession",
                                "meshserve.v1.Worker/Session"]
    for name in sessions:
        assert METHOD_TIMEOUTS_S.get(name, 0) >= 86400 * 365, name


async def _idle_stream_survives(stream: str, min_ping_interval_s: float,
                                idle_s: float = 5.0) -> bool:
    """Hold a stream idle for `idle_s` while the client pings every second (gRPC's client
    floor), then use it again; did it live?

    `stream` is "session" (the server waits to read) or "generate" (the server has read
    a request and waits to write its next output), both on Session streams.
    """
    server = GrpcServer("127.0.0.1:0", service_names=[WORKER],
                        min_ping_interval_s=min_ping_interval_s)
    servicer = FakeWorker()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    port = await server.start()
    channel = GrpcClient(keepalive_time_s=1.0, keepalive_timeout_s=5).channel(
        f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)

    def adding(handle: int) -> worker_pb2.SessionRequest:
        return worker_pb2.SessionRequest(adds=[worker_pb2.SessionAdd(handle=handle)])

    try:
        if stream == "session":
            session = stub.Session()
            await session.write(adding(1))
            assert list((await session.read()).handles) == [1]
        else:
            call = stub.Session(iter([_adding("block")]))
            await call.read()  # the first message; then idle until released
        await asyncio.sleep(idle_s)  # the idle time is what is tested, not a wait for an event
        try:
            if stream == "session":
                await session.write(adding(2))
                reply = await session.read()
                return reply is not grpc.aio.EOF and list(reply.handles) == [2]
            servicer.release.set()
            last = await call.read()
            return last is not grpc.aio.EOF and _entries(last)[0] == [5]
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            return False
    finally:
        await channel.close()
        await server.drain(grace_s=0)


@pytest.mark.parametrize("stream", ["session", "generate"])
async def test_an_idle_stream_outlives_the_servers_ping_limit(stream: str) -> None:
    # The server accepts pings every 0.1 s; the client sends one a second through 5 s of
    # silence: past the 2 strikes a server forgives bad pings.
    assert await _idle_stream_survives(stream, min_ping_interval_s=0.1)


async def test_pings_faster_than_the_server_allows_close_the_stream() -> None:
    # The control: with a server that wants 10 s between pings, the same client is sent
    # away ("too_many_pings"), so the test above can fail. (On an idle bidi stream whose
    # server waits to read, gRPC resets the server's ping clock between the client's pings
    # (GRPC_TRACE=http_keepalive shows next_allowed_ping back at -inf), so a strict server
    # does not close that one within seconds; a stream whose server waits to write shows
    # the policy.)
    assert not await _idle_stream_survives("generate", min_ping_interval_s=10.0)


async def test_the_servers_default_ping_limit_welcomes_clients_of_the_same_keepalive() -> None:
    # Servers and clients built with defaults agree: the server accepts pings 6x more
    # often than the client sends them.
    server_options = dict(GrpcServer("127.0.0.1:0", service_names=[WORKER]).options)
    client_options = dict(GrpcClient().channel_options())
    assert (server_options["grpc.http2.min_ping_interval_without_data_ms"] * 6
            == client_options["grpc.keepalive_time_ms"])
    assert client_options["grpc.keepalive_permit_without_calls"] == 1
    assert client_options["grpc.http2.max_pings_without_data"] == 0
