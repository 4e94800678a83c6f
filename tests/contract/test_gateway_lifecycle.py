"""Client disconnects, Prometheus metrics and trace propagation of the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_fakes import MODEL, Mesh, start_mesh

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 9}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with start_mesh() as started:
        yield started


async def test_client_disconnect_cancels_generate_and_aborts(mesh: Mesh) -> None:
    mesh.worker.hold_after_first = True
    async with aiohttp.ClientSession(mesh.base_url) as http:
        resp = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")  # the stream is live
        resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(mesh.worker.cancelled.wait(), timeout=5)
    await asyncio.wait_for(mesh.worker.aborted.wait(), timeout=5)
    request_id = mesh.worker.requests[0].request_id
    assert [(a.request_id, list(a.indices)) for a in mesh.worker.aborts] == [(request_id, [])]
    await asyncio.wait_for(mesh.scheduler.release_seen.wait(), timeout=5)
    assert mesh.scheduler.released == [request_id]
    registry = mesh.gateway.telemetry.registry
    assert registry.get_sample_value("meshserve:gateway_requests_in_flight") == 0
    assert registry.get_sample_value("meshserve:gateway_requests_total", {
        "endpoint": "/v1/chat/completions", "status": "499"}) == 1


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_expose_counts_and_histograms(mesh: Mesh) -> None:
    async with aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/v1/completions", json={**COMPLETION, "stream": True}) as resp:
            await resp.read()
        async with http.post("/v1/completions", json={**COMPLETION, "model": "nope"}) as resp:
            assert resp.status == 404
        async with http.get("/metrics") as resp:
            assert resp.status == 200
            samples = metric_samples(await resp.text())
    model = (("engine", "gateway"), ("model_name", MODEL))
    assert samples[("meshserve:gateway_requests_total",
                    (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert samples[("meshserve:gateway_requests_total",
                    (("endpoint", "/v1/completions"), ("status", "404")))] == 1
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    # 9 tokens in 3 messages: the first gives TTFT, the two others one ITL sample each.
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 2
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 1
    assert samples[("vllm:generation_tokens_total", model)] == 9
    assert samples[("vllm:request_success_total",
                    tuple(sorted((*model, ("finished_reason", "length")))))] == 1
    assert samples[("meshserve:gateway_requests_in_flight", ())] == 0


async def test_trace_context_reaches_every_service(mesh: Mesh) -> None:
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "safety_identifier": "end-user-7"}
    headers = {"traceparent": traceparent, "X-Request-Id": "caller-42"}
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/chat/completions", headers=headers, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "caller-42"  # echoed
    spans = {span.name: span for span in mesh.spans.get_finished_spans()}
    http_span = spans["POST /v1/chat/completions"]
    assert (http_span.attributes or {})["meshserve.client_request_id"] == "caller-42"
    assert http_span.kind == SpanKind.SERVER
    assert format(http_span.context.trace_id, "032x") == TRACE_ID
    assert http_span.parent is not None
    assert format(http_span.parent.span_id, "016x") == PARENT_SPAN_ID
    for name in ("tokenize", "route", "generate"):
        assert spans[name].context.trace_id == http_span.context.trace_id, name
        assert spans[name].parent is not None
        assert spans[name].parent.span_id == http_span.context.span_id, name
    attributes = http_span.attributes or {}
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["meshserve.request.user"] == "end-user-7"
    assert attributes["gen_ai.usage.input_tokens"] == len(b"<user>hi\n<assistant>")
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert attributes["http.response.status_code"] == 200
    # Each gRPC call, and each request inside a session stream, carries the trace, with
    # the span that made it as the parent; the session streams themselves carry none.
    assert mesh.worker.session_metadata and mesh.tokenizer.session_metadata
    assert mesh.scheduler.session_metadata
    for metadata in (*mesh.worker.session_metadata, *mesh.tokenizer.session_metadata,
                     *mesh.scheduler.session_metadata):
        assert "traceparent" not in metadata
    expected_parents = {
        "tokenizer": [spans["tokenize"], spans["generate"]],
        "scheduler": [spans["route"]],
        "worker": [spans["generate"]],
    }
    recorded = {"tokenizer": mesh.tokenizer.metadata, "scheduler": mesh.scheduler.metadata,
                "worker": mesh.worker.metadata}
    for service, metadata in recorded.items():
        parents = {format(s.context.span_id, "016x") for s in expected_parents[service]}
        for entry in metadata:
            _, trace_id, parent_id, _ = entry["traceparent"].split("-")
            assert trace_id == TRACE_ID, service
            assert parent_id in parents, service


async def _read_events(response: aiohttp.ClientResponse) -> list[bytes]:
    return [e for e in (await asyncio.wait_for(response.read(), timeout=20)).split(b"\n\n") if e]


async def test_a_drain_refuses_new_requests_and_ends_streams_past_its_grace() -> None:
    async with start_mesh(drain_grace_s=1.0) as mesh, aiohttp.ClientSession(mesh.base_url) as http:
        mesh.worker.hold_after_first = True  # two streams that outlast the grace
        streams = [await http.post("/v1/completions", json={**COMPLETION, "stream": True})
                   for _ in range(2)]
        for stream in streams:
            assert stream.status == 200
            assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: {")
        stopping = asyncio.ensure_future(mesh.gateway.drain.run(1.0))
        await asyncio.sleep(0)  # the drain has begun (it sets its flag before awaiting)
        async with http.post("/v1/completions", json=COMPLETION) as refused:
            assert refused.status == 503
            assert refused.headers["Retry-After"] == "1"
            assert "shutting down" in (await refused.json())["error"]["message"]
        async with http.get("/health") as health:
            assert health.status == 503
        for stream in streams:
            events = await _read_events(stream)
            assert b'"error":' in events[-2] and b"shut down" in events[-2], events
            assert events[-1] == b"data: [DONE]"
        await stopping
        await asyncio.wait_for(mesh.worker.cancelled.wait(), timeout=5)  # and so was the worker


async def test_a_drain_lets_streams_that_finish_in_time_complete(mesh: Mesh) -> None:
    async with aiohttp.ClientSession(mesh.base_url) as http:
        stream = await http.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert stream.status == 200
        await mesh.gateway.drain.run(10.0)  # returns once the stream is done
        events = await _read_events(stream)
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"error":' in e for e in events)


async def test_a_streamed_response_echoes_the_callers_request_id(mesh: Mesh) -> None:
    body = {"model": MODEL, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/chat/completions", headers={"X-Request-Id": "caller-43"},
                      json=body) as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "caller-43"
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and "X-Request-Id" not in resp.headers
        await resp.read()
