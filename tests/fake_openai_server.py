"""A small fake OpenAI-compatible server for the serving benchmark's tests.

    with FakeOpenAIServer(plan=lambda n: "ok") as server:
        ... server.url ..., server.bodies, server.max_in_flight

It runs on its own event loop in a thread, so that both an async test and a synchronous CLI
call (which runs `asyncio.run`) can talk to it. The n-th request received (from 0) gets
`plan(n)`: "ok" (a streamed answer of `max_tokens` one-word chunks, then a usage chunk when
asked for and `usage` is on), 429 or 500 (an OpenAI error body), or "stream_error" (a few
chunks, then a `data: {"error": ...}` event). A request counts as in flight from its arrival
until just before its `[DONE]` (or its error response) is written, so the count never exceeds
what the client has in flight. With `cache_block=B` the usage also holds
`prompt_tokens_details.cached_tokens`: the longest run of whole B-token blocks that a token
prompt shares with an earlier one (a prefix cache that never evicts), the last prompt token
never counted, as engines always compute it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Self

import orjson
from aiohttp import web

MODEL = "fake-model"
ERROR_MESSAGES = {429: "the server is overloaded", 500: "internal error (fake)",
                  "stream_error": "the worker went away mid-stream (fake)"}


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class FakeOpenAIServer:
    """/v1/models, /v1/completions and /v1/chat/completions (streaming only) on 127.0.0.1."""

    def __init__(self, plan: Callable[[int], Any] = lambda n: "ok", *,
                 chunk_delay_s: float = 0.001, usage: bool = True,
                 api_key: str | None = None, cache_block: int | None = None) -> None:
        self.plan, self.chunk_delay_s, self.usage, self.api_key = plan, chunk_delay_s, usage, \
            api_key
        self.cache_block = cache_block
        self._cached_prefixes: set[tuple[int, ...]] = set()
        self.bodies: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.in_flight = self.max_in_flight = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(self._runner.addresses[0][1])

    def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get(
            "Authorization") == f"Bearer {self.api_key}"

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        ordinal = len(self.bodies)
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        action = self.plan(ordinal)
        if action in (429, 500):
            self.in_flight -= 1
            return web.json_response({"error": {"message": ERROR_MESSAGES[action],
                                                "type": "error", "code": action}},
                                     status=action)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await self._stream(response, body, action == "stream_error")
        await response.write_eof()
        return response

    async def _stream(self, response: web.StreamResponse, body: dict[str, Any],
                      fail: bool) -> None:
        chat = "messages" in body
        count = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if chat:  # a role-only first chunk, as OpenAI sends: no content, no TTFT
            await response.write(_sse(_chunk(chat, None, role=True)))
        for i in range(count):
            if fail and i == 2:
                self.in_flight -= 1
                await response.write(_sse({"error": {"message": ERROR_MESSAGES["stream_error"],
                                                     "code": 500}}))
                await response.write(b"data: [DONE]\n\n")
                return
            await asyncio.sleep(self.chunk_delay_s)
            await response.write(_sse(_chunk(chat, f" w{i}")))
        await response.write(_sse(_chunk(chat, "", finish="length")))
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": count,
                                     "total_tokens": prompt_tokens + count}
            if self.cache_block is not None and isinstance(prompt, list):
                usage["prompt_tokens_details"] = {"cached_tokens": self._cache(prompt)}
            await response.write(_sse({"choices": [], "usage": usage}))
        self.in_flight -= 1
        await response.write(b"data: [DONE]\n\n")

    def _cache(self, prompt: list[int]) -> int:
        """Tokens of `prompt` found in the cache; then its whole blocks are cached."""
        assert self.cache_block is not None
        ends = range(self.cache_block, len(prompt) + 1, self.cache_block)
        hit = 0
        for end in ends:
            if tuple(prompt[:end]) not in self._cached_prefixes:
                break
            hit = end
        self._cached_prefixes.update(tuple(prompt[:end]) for end in ends)
        return min(hit, (len(prompt) - 1) // self.cache_block * self.cache_block)


def _chunk(chat: bool, text: str | None, *, role: bool = False,
           finish: str | None = None) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {
            "content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                "choices": [choice]}
    return {"id": "c", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
