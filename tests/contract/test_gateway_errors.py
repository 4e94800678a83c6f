"""The gateway's error answers: every failure is the OpenAI error body with its status.

Raw HTTP (aiohttp) so that statuses, headers and bodies are seen as sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from test_gateway_fakes import MAX_MODEL_LEN, MODEL, Mesh, start_mesh

from meshserve.shared.errors import InternalError, OverloadedError, UnavailableError

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# More tokens than the fake worker's first message holds: the request outlives that message.
LONG = {**COMPLETION, "max_tokens": 9}


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with start_mesh() as started:
        yield started


async def call(mesh: Mesh, path: str, body: Any = None, *, data: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    """POST (or GET without a body): status, JSON body, headers."""
    async with aiohttp.ClientSession(mesh.base_url) as http:
        method = "GET" if body is None and data is None else "POST"
        async with http.request(method, path, json=body, data=data, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


def assert_error(status: int, body: dict[str, Any], expected: int, *,
                 param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body shape, with the expected status, param and code."""
    assert status == expected, body
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": 7, "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
])
async def test_bad_requests_are_400(mesh: Mesh, path: str, body: dict[str, Any],
                                    param: str) -> None:
    status, answer, _ = await call(mesh, path, body)
    error = assert_error(status, answer, 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert mesh.worker.requests == []


async def test_malformed_json_is_400(mesh: Mesh) -> None:
    status, body, _ = await call(mesh, "/v1/completions", data=b'{"prompt": "x",',
                                 headers={"Content-Type": "application/json"})
    assert "malformed JSON" in assert_error(status, body, 400, param="body")["message"]


async def test_unknown_model_is_404(mesh: Mesh) -> None:
    status, body, _ = await call(mesh, "/v1/chat/completions", {**CHAT, "model": "nope"})
    assert "nope" in assert_error(status, body, 404, param="model")["message"]


async def test_unknown_path_is_404_with_error_body(mesh: Mesh) -> None:
    status, body, _ = await call(mesh, "/v1/nothing", {})
    assert_error(status, body, 404)


async def test_prompt_past_the_context_is_400(mesh: Mesh) -> None:
    long_prompt = {**COMPLETION, "prompt": "x" * MAX_MODEL_LEN}
    status, body, _ = await call(mesh, "/v1/completions", long_prompt)
    assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    too_many = {**COMPLETION, "max_tokens": MAX_MODEL_LEN}
    status, body, _ = await call(mesh, "/v1/completions", too_many)
    error = assert_error(status, body, 400, param="max_tokens", code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    assert mesh.worker.requests == []


async def test_oversized_body_is_413() -> None:
    async with start_mesh(max_body_bytes=2048) as mesh:
        status, body, _ = await call(mesh, "/v1/completions", {**COMPLETION, "prompt": "x" * 4096})
        assert_error(status, body, 413)
        status, _, _ = await call(mesh, "/v1/completions", COMPLETION)
        assert status == 200


async def test_api_key_is_enforced() -> None:
    async with start_mesh(api_key="sekret") as mesh:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"x-api-key": "wrong"}, {"x-api-key": ""}):
            status, body, _ = await call(mesh, "/v1/completions", COMPLETION, headers=headers)
            assert_error(status, body, 401)
        status, body, _ = await call(mesh, "/v1/models", headers={"Authorization": "Bearer x"})
        assert_error(status, body, 401)
        status, _, _ = await call(mesh, "/health")  # probes stay open
        assert status == 200
        async with openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="sekret",
                                      max_retries=0) as api:
            result = await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert result.choices[0].text
        async with openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="bad",
                                      max_retries=0) as api:
            with pytest.raises(openai.AuthenticationError):
                await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        # Anthropic's clients send the key alone in x-api-key.
        status, _, _ = await call(mesh, "/v1/completions", COMPLETION,
                                  headers={"x-api-key": "sekret"})
        assert status == 200
        assert len(mesh.worker.requests) == 2


async def test_admission_bound_is_429_with_retry_after() -> None:
    async with start_mesh(max_concurrent_requests=1, retry_after_s=3) as mesh, \
            aiohttp.ClientSession(mesh.base_url) as http:
        mesh.worker.hold_after_first = True
        async with http.post("/v1/completions", json={**LONG, "stream": True}) as first:
            assert first.status == 200
            assert (await first.content.readline()).startswith(b"data: ")
            status, body, headers = await call(mesh, "/v1/completions", COMPLETION)
            assert_error(status, body, 429, code="overloaded")
            assert headers["Retry-After"] == "3"
        # The slot comes back once the first request is gone.
        await asyncio.wait_for(mesh.worker.cancelled.wait(), timeout=5)
        mesh.worker.hold_after_first = False
        status, _, _ = await call(mesh, "/v1/completions", COMPLETION)
        assert status == 200


async def test_scheduler_resource_exhausted_is_429(mesh: Mesh) -> None:
    mesh.scheduler.route_error = OverloadedError("global queue is full")
    status, body, headers = await call(mesh, "/v1/chat/completions", CHAT)
    error = assert_error(status, body, 429, code="overloaded")
    assert error["message"] == "global queue is full" and headers["Retry-After"] == "1"


async def test_workers_down_is_503() -> None:
    async with start_mesh(dead_workers=2, max_generate_attempts=2) as mesh:
        mesh.scheduler.workers = mesh.scheduler.workers[:2]  # only the dead ones
        status, body, _ = await call(mesh, "/v1/completions", COMPLETION)
        assert_error(status, body, 503)
        assert len(mesh.scheduler.routes) == 2
        await asyncio.wait_for(mesh.scheduler.release_seen.wait(), timeout=5)


async def test_scheduler_unavailable_is_503(mesh: Mesh) -> None:
    mesh.scheduler.route_error = UnavailableError("no worker serves tiny")
    status, body, _ = await call(mesh, "/v1/completions", COMPLETION)
    assert_error(status, body, 503)


async def test_tokenizer_down_is_503() -> None:
    async with start_mesh(tokenizer_down=True) as mesh:
        status, body, _ = await call(mesh, "/v1/completions", COMPLETION)
        assert_error(status, body, 503)
        status, body, _ = await call(mesh, "/health")
        assert status == 503 and "tokenizer" in body["error"]["message"]


async def test_internal_error_is_500_and_fails_alone(mesh: Mesh) -> None:
    mesh.worker.raise_first = ValueError("boom")
    mesh.worker.raise_marker = "!"
    bad, good = await asyncio.gather(
        call(mesh, "/v1/completions", {**COMPLETION, "prompt": "boom!"}),
        call(mesh, "/v1/completions", COMPLETION))
    assert assert_error(bad[0], bad[1], 500)["type"] == "server_error"
    assert good[0] == 200 and good[1]["choices"][0]["text"]
    mesh.worker.raise_first = InternalError("engine bug")
    status, body, _ = await call(mesh, "/v1/completions", {**COMPLETION, "prompt": "x!"})
    assert "engine bug" in assert_error(status, body, 500)["message"]


async def test_deadline_is_504_and_cancels_the_worker() -> None:
    async with start_mesh(request_timeout_s=0.5) as mesh:
        mesh.worker.hold_after_first = True
        status, body, _ = await call(mesh, "/v1/completions", LONG)
        assert_error(status, body, 504, code="deadline_exceeded")
        await asyncio.wait_for(mesh.worker.cancelled.wait(), timeout=5)


async def test_error_mid_stream_ends_the_stream_with_an_error_event(mesh: Mesh) -> None:
    mesh.worker.fail_after_first = UnavailableError("worker lost its GPU")
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status == 200
        events = [line for line in (await resp.read()).split(b"\n\n") if line]
    assert len(events) == 3
    assert events[0].startswith(b'data: {"id":"cmpl-')
    assert b'"error":' in events[1] and b"worker lost its GPU" in events[1]
    assert events[2] == b"data: [DONE]"


async def test_worker_lost_mid_stream_ends_its_stream_with_an_error_event(mesh: Mesh) -> None:
    mesh.worker.break_after_first = True
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status == 200
        events = [line for line in (await resp.read()).split(b"\n\n") if line]
    # Output went to the client already and no other worker can continue it (the only one
    # is excluded): a clear error and the end of the stream (failover: test_gateway_failover).
    assert events[0].startswith(b'data: {"id":"cmpl-')
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert "failed while generating" in error["message"] and error["code"] == "unavailable"
    assert events[-1] == b"data: [DONE]"
    assert len(mesh.worker.requests) == 1
    mesh.worker.break_after_first = False
    # The gateway opens a new session on the next request.
    status, body, _ = await call(mesh, "/v1/completions", COMPLETION)
    assert status == 200 and body["choices"][0]["text"]


async def test_worker_lost_before_any_output_is_retried_elsewhere() -> None:
    async with start_mesh(dead_workers=1, max_generate_attempts=2) as mesh:
        status, body, _ = await call(mesh, "/v1/completions", COMPLETION)
        assert status == 200 and body["choices"][0]["text"]
        # The first route went to the dead worker, the second excluded it.
        assert [list(r.exclude_worker_ids) for r in mesh.scheduler.routes] == [[], ["dead0"]]


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "messages": _nested(1000, {"role": "user",
                                                                  "content": "hi"})}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": _nested(
        1000, {"type": "text", "text": "hi"})}]}),
    ("/v1/chat/completions", {**CHAT, "tools": _nested(1000, {"type": "function"})}),
    ("/v1/completions", {**COMPLETION, "max_tokens": _nested(1000, 3)}),
    ("/v1/completions", {**COMPLETION, "prompt": _nested(5000, "hi")}),  # past orjson's own limit
])
async def test_deeply_nested_json_is_400(mesh: Mesh, path: str, body: dict[str, Any]) -> None:
    status, payload, _ = await call(mesh, path, data=_dumps_deep(body),
                                    headers={"Content-Type": "application/json"})
    assert_error(status, payload, 400)
    status, _, _ = await call(mesh, "/v1/completions", COMPLETION)  # and nothing else is lost
    assert status == 200


def _dumps_deep(body: dict[str, Any]) -> bytes:
    """JSON deeper than orjson (and Python's recursion limit) will write."""
    import json
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        return json.dumps(body).encode()
    finally:
        sys.setrecursionlimit(limit)


async def _raw_post(mesh: Mesh, header: bytes) -> bytes:
    """POST a completion with one raw header line (bytes no HTTP client would send)."""
    host, port = mesh.base_url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps(COMPLETION)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    return response


async def test_an_authorization_header_of_raw_bytes_is_401() -> None:
    async with start_mesh(api_key="sekret") as mesh:
        response = await _raw_post(mesh, b"Authorization: Bearer \xff\xfe")
        assert response.startswith(b"HTTP/1.1 401"), response[:200]
        status, _, _ = await call(mesh, "/v1/completions", COMPLETION,
                                  headers={"Authorization": "Bearer sekret"})
        assert status == 200


@pytest.mark.parametrize("header", [b"X-Request-Id: \xff\xfe", b"traceparent: \xff\xfe",
                                    b"Authorization: Bearer \xff"])
async def test_other_headers_of_raw_bytes_are_never_a_5xx(mesh: Mesh, header: bytes) -> None:
    response = await _raw_post(mesh, header)
    status = int(response.split(b" ", 2)[1])
    assert status == 200 or 400 <= status < 500, response[:300]


async def test_an_unexpected_error_mid_stream_still_ends_with_an_error_event_and_done(
        mesh: Mesh) -> None:
    mesh.worker.fail_after_first = asyncio.InvalidStateError("invalid state")
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status == 200
        raw = await asyncio.wait_for(resp.read(), timeout=10)
    events = [line for line in raw.split(b"\n\n") if line]
    assert b"HTTP/1.1" not in raw  # no second response written into the stream
    assert b'"error":' in events[-2], events
    assert events[-1] == b"data: [DONE]"
    mesh.worker.fail_after_first = None
    status, _, _ = await call(mesh, "/v1/completions", COMPLETION)
    assert status == 200


async def test_a_gateway_bug_after_the_first_byte_is_an_error_event_not_a_second_response(
        mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshserve.services.gateway.api import handlers

    real = handlers.renderer_for

    def failing_renderer(*args: Any, **kwargs: Any) -> Any:
        renderer = real(*args, **kwargs)
        chunks = renderer.chunks
        calls = 0

        def chunks_then_fail(*a: Any, **k: Any) -> bytes:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise asyncio.InvalidStateError("a bug in the renderer")
            return chunks(*a, **k)

        renderer.chunks = chunks_then_fail
        return renderer

    monkeypatch.setattr(handlers, "renderer_for", failing_renderer)
    async with aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status == 200
        raw = await asyncio.wait_for(resp.read(), timeout=10)
    events = [line for line in raw.split(b"\n\n") if line]
    assert b"HTTP/1.1" not in raw
    assert events[0].startswith(b'data: {"id":"cmpl-')
    assert b'"error":' in events[-2] and b"InvalidStateError" in events[-2], events
    assert events[-1] == b"data: [DONE]"
    await asyncio.wait_for(mesh.scheduler.release_seen.wait(), timeout=5)  # freed
