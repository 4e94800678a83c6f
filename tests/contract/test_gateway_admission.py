"""Admission by capacity through a real gateway and a real scheduler (over a real Redis)
in front of a slow worker: what cannot start within --max-queue-delay-s is refused at once.

The worker (the gateway fakes' FakeWorker, made slow: every request takes SERVICE_S) runs
SLOTS requests at once and is registered with the scheduler as such, without local
queue. Once the scheduler has seen requests end (so that it knows the service time), a
burst of BURST concurrent completions arrives: each one either completes, having waited
at most the bound (plus a margin for a loaded machine), or gets 429 within a second with
an integer Retry-After and an OpenAI error body. The refusals are counted by reason, the
estimate was visible as a gauge, and once the burst has drained requests are admitted
again. loadtest/admission.py's report of the same burst is checked against the stack too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from loadtest_scripts import load_script
from test_gateway_fakes import MAX_MODEL_LEN, MODEL, FakeTokenizer, FakeWorker, _Output, _serve

from meshserve.proto.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from meshserve.services.gateway.app import Gateway
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.service import SchedulerService
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.telemetry import Telemetry

SLOTS = 2  # requests the worker runs at once
SERVICE_S = 1.0  # each request's time on the worker: 2 requests start a second
MAX_QUEUE_DELAY_S = 2.0  # so about 4 may queue behind the 2 running
BURST = 30
REFUSAL_S = 1.0  # a refusal comes back within this
# A 2-core CI machine running every part in this one process can be seconds late: an
# admitted request waits at most the bound plus this.
MARGIN_S = 3.0


class SlowWorker(FakeWorker):
    """Every request spends SERVICE_S on the worker before its tokens (a busy engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.started_at: list[float] = []  # time.monotonic() as each request started

    async def _messages(self, request: worker_pb2.GenerateRequest,
                        resumed: dict[int, list[int]]) -> AsyncIterator[list[_Output]]:
        self.started_at.append(time.monotonic())
        await asyncio.sleep(SERVICE_S)  # the work itself, not a wait for another task
        async for outputs in super()._messages(request, resumed):
            yield outputs


@dataclass
class Stack:
    gateway: Gateway
    gateway_telemetry: Telemetry
    scheduler_telemetry: Telemetry
    worker: SlowWorker
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def gateway_metric(self, name: str, **labels: str) -> float:
        return self.gateway_telemetry.registry.get_sample_value(name, labels) or 0.0

    def scheduler_metric(self, name: str) -> float:
        value = self.scheduler_telemetry.registry.get_sample_value(name)
        assert value is not None, f"{name} is not exported"
        return value


async def _register(scheduler_port: int, worker_address: str) -> None:
    """The worker as the scheduler sees it: SLOTS at once, no local queue; no heartbeat
    follows (the TTL is long), so its load is exactly what was routed and not released."""
    channel = GrpcClient().channel(f"127.0.0.1:{scheduler_port}")
    try:
        await scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(
                info=common_pb2.WorkerInfo(worker_id="w0", epoch=1, address=worker_address,
                                           model_names=[MODEL], block_size=16,
                                           max_model_len=MAX_MODEL_LEN, kv_namespace="ns"),
                load=common_pb2.WorkerLoad(worker_id="w0", epoch=1, max_running=SLOTS)))
    finally:
        await channel.close()


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    servers: list[GrpcServer] = []
    tokenizer_server, tokenizer_address = await _serve(
        "Tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server, FakeTokenizer())
    worker = SlowWorker()
    worker_server, worker_address = await _serve(
        "Worker", worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    servers += [tokenizer_server, worker_server]
    scheduler_telemetry = Telemetry("scheduler")
    scheduler = await SchedulerService.start(
        SchedulerConfig(port=0, drain_grace_s=0, heartbeat_ttl_s=600,
                        max_waiting_per_worker=0, routing="least-loaded"),
        redis_url, scheduler_telemetry)
    await _register(scheduler.port, worker_address)
    gateway_telemetry = Telemetry("gateway")
    gateway = Gateway(GatewayConfig(
        host="127.0.0.1", port=0, served_model_names=(MODEL,),
        tokenizer_addresses=(tokenizer_address,), scheduler_address=f"127.0.0.1:{scheduler.port}",
        drain_grace_s=0.5, max_queue_delay_s=MAX_QUEUE_DELAY_S, access_log=False),
        gateway_telemetry)
    port = await gateway.start()
    try:
        yield Stack(gateway, gateway_telemetry, scheduler_telemetry, worker, port)
    finally:
        await gateway.stop()
        await scheduler.stop(grace_s=0)
        for server in servers:
            await server.drain(grace_s=0)


@dataclass
class Answer:
    status: int
    seconds: float  # from sending to the whole answer
    retry_after: str | None
    body: dict[str, Any]


async def _complete(session: aiohttp.ClientSession, url: str, i: int) -> Answer:
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 3}
    sent = time.monotonic()
    async with session.post(url, json=body) as response:
        payload = await response.json()
        return Answer(response.status, time.monotonic() - sent,
                      response.headers.get("Retry-After"), payload)


async def _many(stack: Stack, count: int, on_refusal: Any = None) -> list[Answer]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> Answer:
            answer = await _complete(session, stack.url, i)
            if answer.status == 429 and on_refusal is not None:
                on_refusal()
            return answer
        return await asyncio.gather(*(one(i) for i in range(count)))


async def test_what_cannot_start_in_time_is_refused_at_once(stack: Stack) -> None:
    # The scheduler learns the service time from requests that end (none refused: the
    # slots are free).
    warmup = await _many(stack, SLOTS)
    assert [a.status for a in warmup] == [200] * SLOTS, [a.body for a in warmup]

    estimates: list[float] = []  # the scheduler's gauge as the first refusals come back
    first_start = len(stack.worker.started_at)
    burst_sent = time.monotonic()
    answers = await _many(stack, BURST, on_refusal=lambda: estimates.append(
        stack.scheduler_metric("meshserve:scheduler_wait_estimate_seconds")))
    statuses = [a.status for a in answers]
    assert set(statuses) == {200, 429}, statuses
    admitted = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    # The running slots and some queue were admitted; most of the burst could not be.
    assert SLOTS < len(admitted) <= SLOTS + 2 * MAX_QUEUE_DELAY_S * SLOTS / SERVICE_S, statuses
    assert len(refused) >= BURST // 2, statuses

    for answer in refused:
        assert answer.seconds < REFUSAL_S, f"a refusal took {answer.seconds:.2f}s"
        assert answer.retry_after is not None and answer.retry_after.isdigit(), answer
        assert 1 <= int(answer.retry_after) <= BURST * SERVICE_S / SLOTS
        error = answer.body["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded", error
        assert "max_queue_delay_s" in error["message"], error
    # Every admitted request started on the worker within the bound (plus the margin).
    starts = stack.worker.started_at[first_start:]
    assert len(starts) == len(admitted)
    waits = [start - burst_sent for start in starts]
    assert max(waits) <= MAX_QUEUE_DELAY_S + MARGIN_S, waits
    for answer in admitted:
        assert answer.seconds <= SERVICE_S + MAX_QUEUE_DELAY_S + MARGIN_S, answer.seconds

    assert stack.gateway_metric("meshserve:gateway_admission_refusals_total",
                                reason="queue_delay") == len(refused)
    assert stack.gateway_metric("meshserve:gateway_admission_refusals_total",
                                reason="ceiling") == 0
    assert estimates and max(estimates) > 0, estimates

    # The burst has drained: a smaller one is admitted whole again (two run, two queue
    # well within the bound).
    again = await _many(stack, 2 * SLOTS)
    assert [a.status for a in again] == [200] * (2 * SLOTS), [a.body for a in again]


async def test_the_admission_loadtest_reports_every_request(stack: Stack) -> None:
    """loadtest/admission.py against this stack: each request of its burst is counted once,
    refusals with their latency and Retry-After, admitted ones with their wait."""
    admission = load_script("admission")
    result = await admission.run(f"http://127.0.0.1:{stack.port}/v1", requests=BURST,
                                 max_tokens=3, warmup=SLOTS, timeout_s=60.0)
    assert result["requests"] == BURST
    assert result["completed"] + result["refused"] == BURST, result
    assert result["refused"] >= BURST // 2 and result["refusals_over_1s"] == 0, result
    assert "missing" not in result["retry_after"], result
    assert result["admitted_wait"]["count"] == result["completed"], result
    assert result["admitted_wait"]["max_s"] <= SERVICE_S + MAX_QUEUE_DELAY_S + MARGIN_S
    assert result["failures"] == [], result
