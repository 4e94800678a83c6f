"""One streamed OpenAI request and what it measured: the benchmark's HTTP client.

    async with open_session(limit=0) as session:
        client = OpenAIClient(session, url, model="m", endpoint="completions", ...)
        output = await client.send(RequestInput(prompt=[1, 2, 3], prompt_len=3, output_len=8))

Every request streams (`stream: true`, `stream_options.include_usage`); the server-sent
events are split incrementally and each parsed once with orjson. A chunk counts as content
when it carries non-empty text (completions `text`, chat `delta.content` or
`delta.reasoning_content`) or token ids: the first sets the TTFT, the others add their gap to
the ITL list. The final usage chunk gives the token counts, prefix-cache hits included
(`usage.prompt_tokens_details.cached_tokens`). A failure never raises: it is recorded in
the output (HTTP status, the server's error message, a mid-stream `{"error": ...}` event, a
timeout, a refused connection).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

_DONE = b"[DONE]"
_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
# How much of a failed response's body the error message keeps.
_ERROR_BODY_CHARS = 500


@dataclass(frozen=True, slots=True)
class RequestInput:
    """One request: token ids or text, its token count when known, output tokens to ask."""

    prompt: list[int] | str
    prompt_len: int | None
    output_len: int


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times are seconds, `start` on the perf_counter clock."""

    success: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    # From the final usage chunk; None when the server did not say.
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens


class SseParser:
    """Incremental server-sent-events splitter: feed bytes, get each finished event's data."""

    __slots__ = ("_data", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The `data` of every event that `chunk` completes (multi-line data joined by \\n)."""
        lines = (self._tail + chunk if self._tail else chunk).split(b"\n")
        self._tail = lines.pop()
        events: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(self._data[0] if len(self._data) == 1
                                  else b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        return events

    def finish(self) -> list[bytes]:
        """The last event when the stream ends without its blank line."""
        events = self.feed(b"\n\n") if self._tail or self._data else []
        return events


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each server-sent event of `response`'s body as it arrives (`[DONE]`
    included), split by `SseParser`."""
    parser = SseParser()
    async for chunk in response.content.iter_any():
        for data in parser.feed(chunk):
            yield data
    for data in parser.finish():
        yield data


def error_message(body: bytes) -> str:
    """The OpenAI error body's message, else the body's start."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:_ERROR_BODY_CHARS].decode("utf-8", "replace").strip() or "(empty body)"
    return event_error(parsed) or str(parsed)[:_ERROR_BODY_CHARS]


def event_error(event: Any) -> str | None:
    """The message of an `{"error": ...}` object (a string or {"message": ...}), or None."""
    if not isinstance(event, dict) or event.get("error") is None:
        return None
    error = event["error"]
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


@asynccontextmanager
async def open_session(limit: int) -> AsyncIterator[aiohttp.ClientSession]:
    """One session for the whole run; `limit` connections at most (0: no limit). Requests
    get their own deadline (`OpenAIClient.timeout_s`), not the session's."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


class OpenAIClient:
    """Sends streamed completions or chat requests and measures each."""

    def __init__(self, session: aiohttp.ClientSession, url: str, *, model: str,
                 endpoint: Literal["completions", "chat"], api_key: str | None = None,
                 ignore_eos: bool = False, temperature: float = 0.0,
                 timeout_s: float = 600.0) -> None:
        self.session, self.url, self.model, self.endpoint = session, url, model, endpoint
        self.ignore_eos, self.temperature, self.timeout_s = ignore_eos, temperature, timeout_s
        self.headers = dict(_JSON_HEADERS)
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def body(self, request: RequestInput) -> dict[str, Any]:
        """The JSON body of `request` (max tokens = its output length)."""
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True},
                                "temperature": self.temperature}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, request: RequestInput) -> RequestResult:
        """Send `request` and measure it; failures are recorded, never raised."""
        out = RequestResult(prompt_len=request.prompt_len or 0)
        data = orjson.dumps(self.body(request))
        out.start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.post(self.url, data=data, headers=self.headers) as resp:
                    out.status = resp.status
                    if resp.status != 200:
                        out.error = error_message(await resp.read())
                    else:
                        await self._read_stream(resp, out, request.prompt_len is None)
        except TimeoutError:
            out.error = f"timed out after {self.timeout_s:g}s"
        except aiohttp.ClientError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        out.latency = time.perf_counter() - out.start
        out.success = not out.error
        return out

    async def _read_stream(self, resp: aiohttp.ClientResponse, out: RequestResult,
                           prompt_len_from_usage: bool) -> None:
        parser, start, chat = SseParser(), out.start, self.endpoint == "chat"
        last, content_chunks, done = 0.0, 0, False
        usage: dict[str, Any] | None = None
        itl = out.itl
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()  # one clock read per network read, not per event
            for data in parser.feed(chunk):
                if data == _DONE:
                    done = True
                    continue
                try:
                    event = orjson.loads(data)
                except orjson.JSONDecodeError:
                    out.error = f"bad event in the stream: {data[:100]!r}"
                    return
                if not isinstance(event, dict):
                    continue
                if event.get("error") is not None:
                    out.error = event_error(event) or "error event in the stream"
                    return
                choices = event.get("choices")
                if choices and _has_content(choices[0], chat):
                    if content_chunks == 0:
                        out.ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    content_chunks += 1
                if event.get("usage"):
                    usage = event["usage"]
        done = done or _DONE in parser.finish()
        if not done:
            out.error = "the stream ended before `data: [DONE]`"
        elif content_chunks == 0:
            out.error = "no content chunk in the stream (no TTFT)"
        _apply_usage(out, usage or {}, content_chunks, prompt_len_from_usage)


def _apply_usage(out: RequestResult, usage: dict[str, Any], content_chunks: int,
                 prompt_len_from_usage: bool) -> None:
    """Token counts from the final usage chunk; content chunks stand in for a missing
    `completion_tokens`."""
    completion_tokens = usage.get("completion_tokens")
    out.output_tokens = (completion_tokens if isinstance(completion_tokens, int)
                         else content_chunks)
    prompt_tokens = usage.get("prompt_tokens")
    if isinstance(prompt_tokens, int):
        out.usage_prompt_tokens = prompt_tokens
        if prompt_len_from_usage:
            out.prompt_len = prompt_tokens
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        out.cached_tokens = cached


def _has_content(choice: dict[str, Any], chat: bool) -> bool:
    if chat:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return True
    elif choice.get("text"):
        return True
    return bool(choice.get("token_ids"))
