"""A Worker service on 127.0.0.1 over a real LLMEngine (tiny random Llama), its KV events
going to a real Redis, for the worker's contract tests; and the in-process references.

References are independent of the service: the same engine class driven in-process (step
until done).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.serving.kv_publisher import KVEventPublisher
from meshserve.services.worker.serving.service import WorkerServicer
from meshserve.shared.grpc_client import GrpcClient, wait_until_serving
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.redis_server import connect
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.telemetry import Telemetry
from meshserve.shared.worker_registry import WorkerInfo

WORKER = "meshserve.v1.Worker"
WORKER_ID = "worker-test"
EPOCH = 7
BLOCK = 16
NUM_BLOCKS = 64
NAMESPACE = "tiny@float32"
PROMPTS = [[5, 17, 99, 3, 250, 42, 8], [300, 301, 302] * 14, list(range(60, 100))]


@dataclass
class Harness:
    engine: LLMEngine
    thread: EngineThread
    publisher: KVEventPublisher
    server: GrpcServer
    stub: worker_pb2_grpc.WorkerStub
    telemetry: Telemetry
    exporter: InMemorySpanExporter
    index: KVIndex
    servicer: WorkerServicer
    draining: list[bool]  # [True]: the servicer reports draining


def engine_config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), dtype="float32", device="cpu",
                        num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=256)


@pytest.fixture
async def worker(tiny_llama_dir: Path, redis_url: str) -> AsyncIterator[Harness]:
    engine = build_engine(engine_config(tiny_llama_dir))
    redis = connect(redis_url)  # a clean database (the redis_url fixture empties it)
    index = KVIndex(redis, NAMESPACE)
    publisher = KVEventPublisher(index, WORKER_ID)
    publisher.start()
    thread = EngineThread(engine, epoch=EPOCH, on_kv_events=publisher.put)
    thread.start()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("worker", span_exporter=exporter)
    info = WorkerInfo(worker_id=WORKER_ID, address="127.0.0.1:0", model_names=("tiny",),
                      block_size=BLOCK, max_model_len=engine.max_model_len,
                      num_total_blocks=NUM_BLOCKS, kv_namespace=NAMESPACE, epoch=EPOCH)
    draining = [False]
    servicer = WorkerServicer(thread, info, tracer=telemetry.tracer,
                              registry=telemetry.registry, draining=lambda: draining[0])
    server = GrpcServer("127.0.0.1:0", service_names=[WORKER], telemetry=telemetry,
                        grace_s=1.0)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
    port = await server.start()
    await server.set_serving()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    await wait_until_serving(channel, WORKER, timeout_s=10)
    try:
        yield Harness(engine, thread, publisher, server, worker_pb2_grpc.WorkerStub(channel),
                      telemetry, exporter, index, servicer, draining)
    finally:
        await channel.close()
        await server.drain(grace_s=1.0)
        thread.stop()
        await thread.wait_stopped()
        await publisher.stop()
        await redis.aclose()


def reference(folder: Path, prompt: list[int], params: SamplingParams,
              warm: list[int] | None = None) -> dict[int, list[SequenceOutput]]:
    """Run one request alone through an in-process engine (after `warm`, if given)."""
    engine = build_engine(engine_config(folder))
    if warm is not None:
        engine.add_request("warm", warm, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request("ref", prompt, params)
    outputs: dict[int, list[SequenceOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.index, []).append(out)
    return outputs


def ref_tokens(outputs: list[SequenceOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def greedy(max_tokens: int, **kw: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def wait_idle(worker: Harness, within_s: float) -> worker_pb2.GetLoadResponse:
    """Poll GetLoad until nothing runs or waits (bounded)."""
    deadline = time.monotonic() + within_s
    while True:
        load = await worker.stub.GetLoad(worker_pb2.GetLoadRequest())
        if load.load.num_running == 0 and load.load.num_waiting == 0:
            return load
        assert time.monotonic() < deadline, f"worker still busy after {within_s}s: {load}"
        await asyncio.sleep(0.01)


def request(rid: str, prompts: list[list[int]], params: common_pb2.SamplingParams
            ) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, prompts=[worker_pb2.Prompt(token_ids=p) for p in prompts],
        params=params)
