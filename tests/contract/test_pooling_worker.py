"""Contract tests of a pooling worker's Worker service: a real grpc.aio server on
127.0.0.1 over the real embedding thread and a tiny random Qwen3 embedder; and the
generating worker's refusal of Embed (over the shared worker harness).

The reference is the embedder itself, called in-process on one input at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from worker_harness import Harness

from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.pooling.batcher import EmbedBatcher
from meshserve.services.worker.pooling.embedder import Embedder
from meshserve.services.worker.pooling.pooler import finish
from meshserve.services.worker.pooling.service import PoolingServicer
from meshserve.shared.grpc_client import GrpcClient, wait_until_serving
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.worker_registry import RUNNER_POOLING, WorkerInfo

WORKER = "meshserve.v1.Worker"
INPUTS = [[5, 6, 7], [9], list(range(20, 45))]


@dataclass
class Pooling:
    embedder: Embedder
    batcher: EmbedBatcher
    stub: worker_pb2_grpc.WorkerStub


@pytest.fixture
async def pooling(tiny_qwen3_dir: Path) -> AsyncIterator[Pooling]:
    embedder = Embedder(EngineConfig(model=str(tiny_qwen3_dir), dtype="float32", device="cpu",
                                     max_model_len=64))
    batcher = EmbedBatcher(embedder)
    batcher.start()
    info = WorkerInfo(worker_id="pool-0", address="127.0.0.1:0", model_names=("tiny",),
                      max_model_len=64, runner=RUNNER_POOLING, embedding_size=64)
    server = GrpcServer("127.0.0.1:0", service_names=[WORKER], grace_s=1.0)
    worker_pb2_grpc.add_WorkerServicer_to_server(PoolingServicer(batcher, info), server.server)
    port = await server.start()
    await server.set_serving()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    await wait_until_serving(channel, WORKER, timeout_s=10)
    try:
        yield Pooling(embedder, batcher, worker_pb2_grpc.WorkerStub(channel))
    finally:
        await channel.close()
        await server.drain(grace_s=1.0)
        batcher.stop()
        await batcher.wait_stopped()


def _embed_request(inputs: list[list[int]], **options: object) -> worker_pb2.EmbedRequest:
    return worker_pb2.EmbedRequest(request_id="e-1",
                                   inputs=[worker_pb2.Prompt(token_ids=i) for i in inputs],
                                   **options)  # type: ignore[arg-type]


async def test_embed_returns_each_inputs_vector(pooling: Pooling) -> None:
    response = await pooling.stub.Embed(_embed_request(INPUTS))
    assert response.dimensions == 64
    assert response.num_prompt_tokens == sum(map(len, INPUTS))
    got = np.frombuffer(response.embeddings, dtype="<f4").reshape(len(INPUTS), 64)
    expected = torch.cat([finish(pooling.embedder.embed([ids]), 64, True) for ids in INPUTS])
    assert np.allclose(got, expected.numpy(), atol=1e-5, rtol=0)
    raw = await pooling.stub.Embed(_embed_request(INPUTS[:1], normalize=False))
    vector = np.frombuffer(raw.embeddings, dtype="<f4")
    assert not np.isclose(np.linalg.norm(vector), 1.0, atol=1e-3)


async def test_bad_inputs_and_dimensions_are_invalid_arguments(pooling: Pooling) -> None:
    cases = [(_embed_request([]), "input"), (_embed_request([[1], []]), "input"),
             (_embed_request([list(range(65))]), "input"),
             (_embed_request([[10**6]]), "input"),
             (_embed_request([[1]], dimensions=32), "dimensions")]  # not a Matryoshka model
    for request, param in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pooling.stub.Embed(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("meshserve-error-param", param) in tuple(refused.value.trailing_metadata())


async def test_a_pooling_worker_refuses_generation(pooling: Pooling) -> None:
    adding = worker_pb2.SessionRequest(adds=[worker_pb2.SessionAdd(
        handle=1, request=worker_pb2.GenerateRequest(
            request_id="g", prompts=[worker_pb2.Prompt(token_ids=[1])]))])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in pooling.stub.Session(iter([adding])):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embedding model" in (refused.value.details() or "")
    info = (await pooling.stub.GetInfo(worker_pb2.GetInfoRequest())).info
    assert (info.runner, info.embedding_size) == (common_pb2.RUNNER_POOLING, 64)


async def test_a_generating_worker_refuses_embed(worker: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await worker.stub.Embed(_embed_request([[1, 2]]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation model" in (refused.value.details() or "")
    info = (await worker.stub.GetInfo(worker_pb2.GetInfoRequest())).info
    assert info.runner == common_pb2.RUNNER_GENERATE
