"""Detokenization failover at the gateway, with the real Tokenizer servicer: the replica is
stopped mid-stream and started again on its address, and the stream goes on.

The fake worker pauses after its first message; the tokenizer server is drained (its
DetokenizeSession breaks) and a new one starts on the same port, then the worker goes on.
The client must see exactly what an undisturbed run of the same request shows: both
sequences' text (cut by a stop string that spans the cut), logprob tokens, finish reasons
and usage, with no error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from test_gateway_fakes import CHUNK, MODEL, FakeWorker, Mesh, script, start_mesh
from tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from meshserve.proto.v1 import tokenizer_pb2_grpc
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import SERVICE_NAME, TokenizerServicer
from meshserve.shared.grpc_server import GrpcServer

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture
def served(hf: PreTrainedTokenizerFast) -> ServedModel:
    return ServedModel(Tokenizer(hf, name=MODEL), (MODEL,), MAX_MODEL_LEN)


@pytest.fixture
async def mesh(hf: PreTrainedTokenizerFast, served: ServedModel) -> AsyncIterator[Mesh]:
    worker = FakeWorker(encode=lambda text: list(hf.encode(text, add_special_tokens=False)),
                        eos=hf.convert_tokens_to_ids("<|endoftext|>"))
    async with start_mesh(tokenizer=TokenizerServicer(served), worker=worker) as started:
        yield started


def spanning_stop(hf: PreTrainedTokenizerFast) -> str:
    """A stop string that begins in the first message's text and ends after it: its first
    characters are held back by the stop checker at the cut (the scripts differ only in
    their first characters, so both sequences meet it)."""
    first = hf.decode(hf.encode(script(0), add_special_tokens=False)[:CHUNK])
    stop = script(0)[len(first) - 2:len(first) + 2]
    assert script(0).find(stop) == len(first) - 2
    return stop


def events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, up to `[DONE]` (which must end it)."""
    lines = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]", lines[-1]
    return [orjson.loads(line) for line in lines[:-1]]


def seen(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per choice: text, logprob tokens and finish reason; and the usage."""
    assert not [c for c in chunks if "error" in c], chunks
    out: dict[str, Any] = {"usage": chunks[-1]["usage"]}
    for chunk in chunks:
        for choice in chunk["choices"]:
            mine = out.setdefault(choice["index"], {"text": "", "tokens": [], "reason": None})
            mine["text"] += choice["text"]
            mine["tokens"] += (choice["logprobs"] or {}).get("tokens") or []
            mine["reason"] = choice["finish_reason"] or mine["reason"]
    return out


async def restart_tokenizer(mesh: Mesh, served: ServedModel) -> GrpcServer:
    """Drain the tokenizer server (its streams break) and serve again on its port."""
    old = mesh.servers["tokenizer"]
    address = mesh.gateway.config.tokenizer_addresses[0]
    await old.drain(grace_s=0)
    server = GrpcServer(address, service_names=[SERVICE_NAME], grace_s=0)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(served),
                                                       server.server)
    await server.start()
    await server.set_serving()
    mesh.servers["tokenizer"] = server  # start_mesh drains it at the end
    return server


async def test_a_stream_goes_on_after_its_tokenizer_restarts(
        mesh: Mesh, served: ServedModel, hf: PreTrainedTokenizerFast) -> None:
    stop = spanning_stop(hf)
    body = {"model": MODEL, "prompt": "The fox", "max_tokens": 100, "n": 2, "logprobs": 1,
            "stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/v1/completions", json=body) as resp:
            undisturbed = seen(events(await resp.read()))
        mesh.worker.pause_after_first = asyncio.Event()
        async with http.post("/v1/completions", json=body) as resp:
            first = await resp.content.readuntil(b"\n\n")  # the first message's answer
            await restart_tokenizer(mesh, served)
            mesh.worker.pause_after_first.set()
            moved = seen(events(first + await resp.read()))
    for i in (0, 1):
        assert undisturbed[i]["text"] == script(i)[:script(i).find(stop)]
        assert undisturbed[i]["reason"] == "stop" and undisturbed[i]["tokens"]
    assert moved == undisturbed
    registry = mesh.gateway.telemetry.registry
    assert registry.get_sample_value("meshserve:gateway_detokenize_failovers_total",
                                     {"outcome": "moved"}) == 1
