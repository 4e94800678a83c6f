"""Failover at the gateway: a worker lost mid-generation, the request continued elsewhere.

Two fake workers: "w0" (the first routed to) ends its whole Session stream with
UNAVAILABLE after its first message (the worker died), "w1" takes the request over. The
fakes' scripts fix what the client must see: the whole text of each sequence exactly
once, as if no worker had been lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI
from test_gateway_fakes import CACHED_TOKENS, CHUNK, MODEL, FakeWorker, Mesh, script, start_mesh

PROMPT = "Hi there"


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with start_mesh(spare=FakeWorker()) as started:
        started.worker.break_after_first = True
        yield started


@pytest.fixture
async def api(mesh: Mesh) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=20) as opened:
        yield opened


def failovers(mesh: Mesh, outcome: str) -> float:
    value = mesh.gateway.telemetry.registry.get_sample_value(
        "meshserve:gateway_failovers_total", {"outcome": outcome})
    return value or 0.0


def full(index: int) -> str:
    return script(index)


async def test_a_stream_continues_on_another_worker_without_repeating_text(
        mesh: Mesh, api: AsyncOpenAI) -> None:
    stream = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100,
                                          stream=True, stream_options={"include_usage": True})
    texts: list[str] = []
    reasons = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(texts) == full(0)
    assert [r for r in reasons if r] == ["stop"]
    # w0 sent one message (CHUNK tokens); w1 got the prompt and those tokens, and no more.
    assert len(mesh.worker.requests) == 1
    (resumed,) = [r for r in mesh.scheduler.routes if list(r.exclude_worker_ids) == ["w0"]]
    assert resumed.request_id == mesh.worker.requests[0].request_id
    # Usage is of the whole request: the original prompt, every output token (EOS too).
    assert usage is not None
    assert usage.prompt_tokens == len(PROMPT) + 1  # BOS
    assert usage.completion_tokens == len(full(0).encode()) + 1
    assert usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    assert failovers(mesh, "resumed") == 1
    (generate,) = [s for s in mesh.spans.get_finished_spans() if s.name == "generate"]
    (event,) = [e for e in generate.events if e.name == "failover"]
    assert event.attributes["meshserve.from_worker_id"] == "w0"
    assert event.attributes["meshserve.to_worker_id"] == "w1"
    assert event.attributes["meshserve.tokens_carried"] == CHUNK
    assert generate.attributes["meshserve.failovers"] == 1


async def test_the_new_worker_gets_each_unfinished_sequence_with_its_tokens() -> None:
    taker = FakeWorker()
    async with start_mesh(spare=taker) as mesh, AsyncOpenAI(
            base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0) as api:
        mesh.worker.break_after_first = True
        result = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, n=2)
        assert [c.text for c in result.choices] == [full(0), full(1)]
        assert taker.resumed == [{i: list(full(i).encode()[:CHUNK]) for i in (0, 1)}]
        # The same request (id, prompt, parameters) under the same deadline.
        (lost,), (taken,) = mesh.worker.requests, taker.requests
        assert (taken.request_id, taken.prompts, taken.params) == (
            lost.request_id, lost.prompts, lost.params)
        assert abs(taken.deadline_unix_ns - lost.deadline_unix_ns) < 10**9
        assert result.usage.completion_tokens == sum(len(full(i).encode()) + 1 for i in (0, 1))


async def test_a_stop_string_across_the_seam_still_stops(mesh: Mesh, api: AsyncOpenAI) -> None:
    # w0 sends "s0 " and is lost; "0 h" spans both workers' tokens: the text held back
    # by the detokenizer before the loss must be matched with w1's first tokens.
    result = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100,
                                          stop=["0 h"])
    assert result.choices[0].text == "s"
    assert result.choices[0].finish_reason == "stop"
    assert failovers(mesh, "resumed") == 1


async def _stream_events(mesh: Mesh, body: dict[str, object]) -> list[bytes]:
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        return [line for line in (await resp.read()).split(b"\n\n") if line]


@pytest.mark.parametrize("with_spare", [True, False])
async def test_without_failover_or_another_worker_the_stream_ends_with_an_error(
        with_spare: bool) -> None:
    settings = {"max_failovers": 0} if with_spare else {}
    async with start_mesh(spare=FakeWorker() if with_spare else None, **settings) as mesh:
        mesh.worker.break_after_first = True
        events = await _stream_events(mesh, {"model": MODEL, "prompt": PROMPT,
                                             "max_tokens": 100})
        assert orjson.loads(events[0].removeprefix(b"data: "))["choices"][0]["text"] == (
            full(0)[:CHUNK])
        error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "unavailable"
        assert "worker w0 failed while generating" in error["message"]
        assert ("max_failovers" if with_spare else "no other worker") in error["message"]
        assert events[-1] == b"data: [DONE]"
        assert failovers(mesh, "exhausted" if with_spare else "unplaced") == 1
        assert failovers(mesh, "resumed") == 0


async def test_non_streaming_without_another_worker_is_a_503_naming_the_loss() -> None:
    async with start_mesh() as mesh:
        mesh.worker.break_after_first = True
        async with aiohttp.ClientSession(mesh.base_url) as http, http.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                         "max_tokens": 100}) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
        assert error["code"] == "unavailable"
        assert "worker w0 failed while generating" in error["message"]


async def test_a_second_loss_moves_the_request_again_up_to_the_bound() -> None:
    second = FakeWorker()
    second.break_after_first = True
    async with start_mesh(spare=second, max_failovers=1) as mesh:
        mesh.worker.break_after_first = True
        events = await _stream_events(mesh, {"model": MODEL, "prompt": PROMPT,
                                             "max_tokens": 100})
        text = "".join(orjson.loads(e.removeprefix(b"data: "))["choices"][0]["text"]
                       for e in events[:-2])
        assert text == full(0)[:2 * CHUNK]  # w0's tokens, then w1's, each once
        error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert "worker w1 failed while generating" in error["message"]
        assert "moved 1 time(s) already, max_failovers 1" in error["message"]
        assert second.resumed == [{0: list(full(0).encode()[:CHUNK])}]
        assert failovers(mesh, "resumed") == 1 and failovers(mesh, "exhausted") == 1
