"""CORS: browsers on an allowed origin may call the API (preflights answered, headers on
every response, streamed ones too); other origins, and every origin when none is
configured, get no CORS permission."""

from __future__ import annotations

import aiohttp
from test_gateway_fakes import MODEL, start_mesh

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_an_allowed_origin_gets_preflights_and_headers() -> None:
    async with start_mesh(allowed_origins=(ORIGIN,), api_key="k") as mesh, \
            aiohttp.ClientSession(mesh.base_url) as http:
        # The preflight carries no key (browsers send none) and is answered.
        async with http.options("/v1/chat/completions", headers=PREFLIGHT) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert "authorization" in resp.headers["Access-Control-Allow-Headers"].lower()
        for stream in (False, True):
            async with http.post("/v1/chat/completions", json={**BODY, "stream": stream},
                                 headers={"Origin": ORIGIN, "Authorization": "Bearer k"}
                                 ) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
                await resp.read()
        # The key is still required on the request itself.
        async with http.post("/v1/chat/completions", json=BODY,
                             headers={"Origin": ORIGIN}) as resp:
            assert resp.status == 401
        # Another origin is not allowed.
        async with http.options("/v1/chat/completions",
                                headers={**PREFLIGHT, "Origin": "https://evil.example"}) as resp:
            assert "Access-Control-Allow-Origin" not in resp.headers


async def test_without_allowed_origins_there_is_no_cors() -> None:
    async with start_mesh() as mesh, aiohttp.ClientSession(mesh.base_url) as http:
        async with http.options("/v1/chat/completions", headers=PREFLIGHT) as resp:
            assert resp.status == 405
            assert "Access-Control-Allow-Origin" not in resp.headers
        async with http.post("/v1/chat/completions", json=BODY,
                             headers={"Origin": ORIGIN}) as resp:
            assert resp.status == 200
            assert "Access-Control-Allow-Origin" not in resp.headers
