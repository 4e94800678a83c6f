"""A Tokenizer service on 127.0.0.1 over the tiny model folder's tokenizer, for the
tokenizer's contract tests (fixtures `hf`, `served`, `harness`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from meshserve.proto.v1 import tokenizer_pb2_grpc
from meshserve.services.tokenizer.__main__ import load_served_model
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import SERVICE_NAME, TokenizerServicer
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.telemetry import Telemetry

NAME = "tiny"


@dataclass
class Harness:
    server: GrpcServer
    stub: tokenizer_pb2_grpc.TokenizerStub
    channel: grpc.aio.Channel
    telemetry: Telemetry
    exporter: InMemorySpanExporter


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    """The reference: the model folder's own Hugging Face tokenizer."""
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir), local_files_only=True)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> ServedModel:
    return load_served_model(TokenizerConfig(model=str(tiny_llama_dir), served_model_name=NAME))


@pytest.fixture
async def harness(served: ServedModel) -> AsyncIterator[Harness]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("tokenizer", span_exporter=exporter)
    server = GrpcServer("127.0.0.1:0", service_names=[SERVICE_NAME], telemetry=telemetry,
                        grace_s=5)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(
        TokenizerServicer(served, telemetry=telemetry), server.server)
    port = await server.start()
    await server.set_serving()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    yield Harness(server, tokenizer_pb2_grpc.TokenizerStub(channel), channel, telemetry,
                  exporter)
    await channel.close()
    await server.drain(grace_s=0)
