"""The gateway's access log: one line per API request, none for probes, none when off."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from test_gateway_fakes import MODEL, start_mesh

BODY = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
LOGGER = "meshserve.services.gateway.access"


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


async def test_each_api_request_is_logged_once_and_probes_are_not(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with start_mesh() as mesh, aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/v1/chat/completions", json=BODY,
                             headers={"X-Request-Id": "r-9"}) as resp:
            assert resp.status == 200
            await resp.read()
        async with http.post("/v1/chat/completions", json={**BODY, "stream": True}) as resp:
            await resp.read()
        async with http.get("/health") as resp:
            await resp.read()
        async with http.post("/v1/completions", json={"model": MODEL}) as resp:
            assert resp.status == 400
            await resp.read()
    records = access_records(caplog)
    assert [(r.url_path, r.http_status) for r in records] == [  # type: ignore[attr-defined]
        ("/v1/chat/completions", 200), ("/v1/chat/completions", 200), ("/v1/completions", 400)]
    assert records[0].request_id == "r-9"  # type: ignore[attr-defined]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in records[0].getMessage()
    assert all(r.seconds >= 0 for r in records)  # type: ignore[attr-defined]


async def test_no_access_log_when_it_is_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with start_mesh(access_log=False) as mesh, \
            aiohttp.ClientSession(mesh.base_url) as http, \
            http.post("/v1/chat/completions", json=BODY) as resp:
        assert resp.status == 200
        await resp.read()
    assert not access_records(caplog)
