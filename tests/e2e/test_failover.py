"""Failover end to end: `kill -9` a worker under 20 streams, and no client notices.

One `meshserve up` stack (start_stack) with two workers on a tiny model, driven by the
real `openai` client. A worker is killed once every stream has received tokens; the
streams it was running continue on the other worker from the tokens they had, so each
stream completes with exactly the text of its unkilled run (greedy, and seeded sampling
at temperature 1). Without failover (max_failovers 0), or with no worker left to take
over, a stream ends with a clear error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import orjson
import pytest
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from meshserve.services.gateway.app import Gateway
from meshserve.services.gateway.config import GatewayConfig
from meshserve.shared.telemetry import Telemetry

MODEL = "tiny"
STREAMS = 20
MAX_TOKENS = 300
# The seeded stream starts first and must still run when the 20 others have started.
SEEDED_MAX_TOKENS = 1200
STARTED_CHUNKS = 3  # chunks with text a stream has before the kill
BACK_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("failover-model"), "llama", seed=11,
                            max_position_embeddings=4096)


@pytest.fixture(scope="module")
def whole_characters(model_dir: Path) -> dict[str, float]:
    """A logit_bias that bans every token whose text is not whole characters.

    The random model otherwise strings stray UTF-8 bytes together, whose text depends on
    how the tokens were grouped into messages (the detokenizer gives up holding a broken
    character after a while): two runs of the same tokens could differ in text. With whole
    characters only, the text is the tokens' texts joined, however they were grouped.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    banned = [t for t in range(vocab) if t >= len(tokenizer)
              or not (text := tokenizer.decode([t], skip_special_tokens=True))
              or "\ufffd" in text]
    assert len(banned) < vocab - 100, "too few tokens left"
    return {str(t): -100.0 for t in banned}


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=2, port=0,
                            num_kv_blocks=2048, dtype="float32", device="cpu", kvstore=False,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=5)
    with start_stack(config) as running:
        yield running


def chat_body(i: int, bias: dict[str, float], seed: int | None = None) -> dict[str, Any]:
    """Request i: its own prompt (no shared prefix draws all of them to one worker)."""
    body: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": f"{i}: tell me a story"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "logit_bias": bias,
        "extra_body": {"ignore_eos": True}}
    if seed is not None:
        body.update(temperature=1.0, seed=seed, max_tokens=SEEDED_MAX_TOKENS)
    return body


@dataclass
class Stream:
    """What one client stream received."""

    body: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def run_stream(client: openai.AsyncOpenAI, stream: Stream) -> None:
    """Read one chat stream to its end; `started` is set after STARTED_CHUNKS chunks (or
    at its end, so that nobody waits for a stream that is over)."""
    try:
        response = await client.chat.completions.create(stream=True, **stream.body)
        async for chunk in response:
            for choice in chunk.choices:
                if choice.delta.content:
                    stream.parts.append(choice.delta.content)
                stream.finish_reason = choice.finish_reason or stream.finish_reason
            if len(stream.parts) >= STARTED_CHUNKS:
                stream.started.set()
    except openai.APIError as exc:
        stream.error = exc
    finally:
        stream.started.set()


def running_on(address: str) -> int:
    """Requests running on the worker at `address` (its own GetLoad)."""
    with grpc.insecure_channel(address) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                           timeout=5.0).load
    return int(load.num_running)


def the_busy_worker(stack: Stack) -> str:
    """The id of the one worker running requests now."""
    busy = [w for w, address in zip(stack.worker_ids, stack.worker_addresses, strict=True)
            if running_on(address)]
    assert len(busy) == 1, busy
    return busy[0]


def epochs(stack: Stack) -> dict[str, int]:
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5.0)
    return {w.info.worker_id: w.info.epoch for w in listed.workers}


def wait_back(stack: Stack, before: dict[str, int], killed: list[str]) -> None:
    """Wait until every worker runs and is registered, each of `killed` again under a new
    epoch (the next test needs both workers)."""
    assert killed, "nothing was killed"
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            now = epochs(stack)
        except grpc.RpcError:
            now = {}
        if set(now) == set(stack.worker_ids) and all(
                stack.service_healthy(w) for w in stack.worker_ids) and all(
                now[w] != before[w] for w in killed):
            return
        time.sleep(0.2)  # polling the registry: a restart gives no other signal
    raise AssertionError(f"workers not back within {BACK_TIMEOUT_S}s: {epochs(stack)}")


def failovers(stack: Stack, outcome: str) -> float:
    """The gateway's meshserve:gateway_failovers_total for `outcome`."""
    (url,) = stack.gateway_metrics_urls
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    found = re.search(rf'meshserve:gateway_failovers_total{{outcome="{outcome}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


async def run_all(client: openai.AsyncOpenAI, streams: list[Stream]) -> None:
    await asyncio.gather(*(run_stream(client, s) for s in streams))


def test_streams_on_a_killed_worker_complete_with_their_unkilled_text(
        stack: Stack, whole_characters: dict[str, float]) -> None:
    bodies = [chat_body(i, whole_characters) for i in range(STREAMS)]
    seeded_body = chat_body(STREAMS, whole_characters, seed=20240)

    async def scenario() -> tuple[list[Stream], list[Stream], int, float]:
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused",
                                      max_retries=0, timeout=120) as client:
            reference = [Stream(b) for b in [*bodies, seeded_body]]
            await run_all(client, reference)
            # The seeded stream first, alone: the one worker running it is the one killed.
            seeded = Stream(seeded_body)
            seeded_task = asyncio.ensure_future(run_stream(client, seeded))
            await asyncio.wait_for(seeded.started.wait(), 60)
            victim = the_busy_worker(stack)
            victims.append(victim)
            streams = [Stream(b) for b in bodies]
            tasks = [asyncio.ensure_future(run_stream(client, s)) for s in streams]
            await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 120)
            assert seeded.finish_reason is None, "the seeded stream ended before the kill"
            running = running_on(stack.worker_addresses[stack.worker_ids.index(victim)])
            resumed_before = failovers(stack, "resumed")
            stack.kill(victim, signal.SIGKILL)
            await asyncio.gather(seeded_task, *tasks)
            moved = failovers(stack, "resumed") - resumed_before
            return reference, [*streams, seeded], running, moved

    before = epochs(stack)
    victims: list[str] = []
    reference, killed, running, moved = asyncio.run(scenario())
    for ref in reference:
        assert ref.error is None and ref.finish_reason == "length", ref
    for ref, got in zip(reference, killed, strict=True):
        assert got.error is None, got.error
        assert got.finish_reason == "length"
        assert got.text == ref.text, got.body
    # The killed worker had the seeded stream and others; each moved once.
    assert running >= 1 and moved >= running, (running, moved)
    log = Path(stack.run_dir, "gateway.log").read_text(errors="replace")
    assert len(re.findall(r"failed over from worker \S+ to \S+ carrying \d+ output tokens",
                          log)) >= moved
    wait_back(stack, before, victims)


async def _raw_stream(base_url: str, body: dict[str, Any],
                      on_started: Any) -> list[dict[str, Any] | str]:
    """One SSE stream read raw: its events (JSON objects, or "[DONE]"); `on_started` is
    called (in a thread) once STARTED_CHUNKS chunks with text arrived."""
    events: list[dict[str, Any] | str] = []
    chunks = 0
    async with aiohttp.ClientSession() as http, http.post(
            f"{base_url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            events.append(data if data == "[DONE]" else orjson.loads(data))
            if isinstance(events[-1], dict) and events[-1].get("choices"):
                chunks += bool(events[-1]["choices"][0]["text"])
                if chunks == STARTED_CHUNKS:
                    await asyncio.to_thread(on_started)
    return events


COMPLETION = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 2000,
              "temperature": 0, "ignore_eos": True}


def _assert_ended_by_error(events: list[dict[str, Any] | str], *fragments: str) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and "error" in error, events[-3:]
    assert error["error"]["code"] == "unavailable"
    for fragment in fragments:
        assert fragment in error["error"]["message"], error
    assert all(isinstance(e, dict) and "choices" in e for e in events[:-2])


def test_with_max_failovers_0_a_stream_on_a_killed_worker_ends_with_an_error(
        stack: Stack) -> None:
    before = epochs(stack)
    victims: list[str] = []

    def kill_busy() -> None:
        victims.append(the_busy_worker(stack))
        stack.kill(victims[-1], signal.SIGKILL)

    async def scenario() -> list[dict[str, Any] | str]:
        # A second gateway in this process, on the stack's tokenizer and scheduler.
        gateway = Gateway(GatewayConfig(
            host="127.0.0.1", port=0, served_model_names=(MODEL,),
            tokenizer_addresses=tuple(stack.tokenizer_addresses),
            scheduler_address=stack.scheduler_address, max_failovers=0, drain_grace_s=1.0),
            Telemetry("gateway"))
        port = await gateway.start()
        try:
            return await _raw_stream(f"http://127.0.0.1:{port}", COMPLETION, kill_busy)
        finally:
            await gateway.stop()

    _assert_ended_by_error(asyncio.run(scenario()), "failed while generating",
                           "max_failovers 0")
    wait_back(stack, before, victims)


def test_with_no_other_worker_left_a_stream_ends_with_an_error(stack: Stack) -> None:
    before = epochs(stack)

    def kill_both() -> None:
        busy = the_busy_worker(stack)
        (other,) = [w for w in stack.worker_ids if w != busy]
        stack.kill(other, signal.SIGKILL)  # the one that could have taken over goes first
        stack.kill(busy, signal.SIGKILL)

    unplaced = failovers(stack, "unplaced")
    events = asyncio.run(_raw_stream(stack.gateway_url, COMPLETION, kill_both))
    _assert_ended_by_error(events, "failed while generating", "no other worker could take it")
    assert failovers(stack, "unplaced") == unplaced + 1
    wait_back(stack, before, list(stack.worker_ids))
