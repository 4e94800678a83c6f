"""The soak's client side (loadtest/soak.py): a mixed load and every request's fate.

`Load(stack_url, model, ...)` runs `concurrency` client loops until `stop()`; each loop
sends one request at a time, of a kind drawn by weight:

- `stream`: a streamed /v1/completions; done on its finish_reason and `[DONE]`;
- `chat`: a non-streamed /v1/chat/completions; done on a 200 with a finish_reason;
- `cancel`: a streamed completion the client drops after a few chunks (as a user closing
  the tab): its fate is `cancelled` once it got them;
- `bad`: one of BAD_BODIES (invalid values, unknown model, broken JSON, a prompt over
  max_model_len): must get a 4xx;
- `long`: a completion whose prompt is `long_prompt_tokens` token ids.

Fates: `completed`, `rejected` (the 4xx a bad input must get), `cancelled`, `overloaded`
(429: admission refused it, as it may), `gateway_cut` (a transport failure of a request
that was open when a gateway was killed, or sent within STALE_S after, ending within
GATEWAY_CUT_S of it: the process holding its socket was gone; which gateway held a
connection is not known to the client, so the timing decides; counted and listed
apart), and the failures that must not
happen: `lost` (cut with no gateway killed), `server_error` (5xx), `error_event` (an
error event in a stream), `unexpected` (a 4xx for a good request, a 2xx for a bad one, a
malformed answer) and `hung` (no answer within `timeout_s`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any

import aiohttp

from meshserve.bench.serve.client import sse_events

KINDS = {"stream": 35, "chat": 20, "cancel": 15, "bad": 15, "long": 15}
FAILURES = ("lost", "server_error", "error_event", "unexpected", "hung")
GATEWAY_CUT_S = 5.0
STALE_S = 1.0
CANCEL_AFTER_CHUNKS = 3


@dataclasses.dataclass
class Fate:
    """How one request ended (times in seconds since the load started)."""

    id: int
    kind: str
    sent_s: float
    ended_s: float = 0.0
    status: int | None = None
    outcome: str = ""
    detail: str | None = None


def bad_bodies(model: str, max_model_len: int) -> list[tuple[str, bytes]]:
    """(path, raw body) of requests the gateway must refuse with a 4xx."""
    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "prompt": "Hi", "max_tokens": 4, **fields}).encode()

    return [
        ("/completions", body(max_tokens=-1)),
        ("/completions", body(temperature=-1.0)),
        ("/completions", body(n=0)),
        ("/completions", body(model="no-such-model")),
        ("/completions", body(prompt=[7] * (max_model_len + 1))),
        ("/completions", b'{"model": "' + model.encode() + b'", "prompt": "Hi", '),
        ("/chat/completions", body(messages="not a list")),
        ("/chat/completions", json.dumps({"model": model}).encode()),
    ]


class Load:
    """Client loops against one gateway URL; `fates` fills as requests end."""

    def __init__(self, base_url: str, model: str, *, max_model_len: int, concurrency: int,
                 max_tokens: int, long_prompt_tokens: int, timeout_s: float,
                 seed: int) -> None:
        self.base_url = base_url
        self.model = model
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.long_prompt_tokens = min(long_prompt_tokens, max_model_len - max_tokens)
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.bad = bad_bodies(model, max_model_len)
        self.fates: list[Fate] = []
        self.gateway_kills: list[float] = []  # seconds since start, told by the soak
        self.started = time.monotonic()
        self._stopping = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        """No new requests; those in flight run to their end."""
        self._stopping.set()

    async def run(self) -> None:
        """The client loops, until `stop()` and every request has ended."""
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._loop(session) for _ in range(self.concurrency)))

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while not self._stopping.is_set():
            kind = self.rng.choices(kinds, weights)[0]
            fate = Fate(len(self.fates), kind, self.now())
            self.fates.append(fate)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await getattr(self, f"_{kind}")(session, fate)
            except TimeoutError:
                fate.outcome, fate.detail = "hung", f"no end within {self.timeout_s:g}s"
            except (aiohttp.ClientError, ConnectionError) as exc:
                fate.outcome, fate.detail = "lost", f"{type(exc).__name__}: {exc}"
            except (ValueError, KeyError, IndexError) as exc:  # an answer not as specified
                fate.outcome, fate.detail = "unexpected", f"{type(exc).__name__}: {exc}"
            fate.ended_s = self.now()
            if fate.outcome == "lost" and self._open_at_gateway_kill(fate):
                fate.outcome = "gateway_cut"

    def _open_at_gateway_kill(self, fate: Fate) -> bool:
        # Sent up to STALE_S after the kill: it may have gone out on a kept-alive connection
        # to the dead gateway before the client's event loop read that connection's end.
        return any(fate.sent_s <= kill + STALE_S and kill <= fate.ended_s <= kill + GATEWAY_CUT_S
                   for kill in self.gateway_kills)

    def _prompt(self, fate: Fate) -> str:
        return f"{fate.id}: tell me about the sea, the ships and the harbour."

    async def _stream(self, session: aiohttp.ClientSession, fate: Fate,
                      prompt: Any = None, cancel_after: int | None = None) -> None:
        body = {"model": self.model, "prompt": prompt or self._prompt(fate),
                "max_tokens": self.max_tokens, "temperature": 0.7, "stream": True}
        async with session.post(f"{self.base_url}/completions", json=body) as response:
            fate.status = response.status
            if not _answered_ok(fate, response.status, await _head(response)):
                return
            chunks, finish, done = 0, None, False
            async for data in sse_events(response):
                if data == b"[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    fate.outcome, fate.detail = "error_event", json.dumps(event["error"])
                    return
                chunks += 1
                finish = event["choices"][0].get("finish_reason") or finish
                if cancel_after is not None and chunks >= cancel_after:
                    fate.outcome = "cancelled"
                    response.close()  # the connection with it: the client went away
                    return
        if done and finish is not None:
            fate.outcome = "completed"
        else:
            fate.outcome = "lost"
            fate.detail = f"ended after {chunks} chunks, finish {finish}, [DONE] {done}"

    async def _cancel(self, session: aiohttp.ClientSession, fate: Fate) -> None:
        await self._stream(session, fate, cancel_after=CANCEL_AFTER_CHUNKS)
        if fate.outcome == "completed":  # shorter than the cut: it simply finished
            fate.outcome = "cancelled"

    async def _long(self, session: aiohttp.ClientSession, fate: Fate) -> None:
        # Ids under 400: in any vocabulary, the tiny test model's (450 tokens) included.
        start = self.rng.randrange(390)
        ids = [10 + (start + 7 * i) % 390 for i in range(self.long_prompt_tokens)]
        await self._stream(session, fate, prompt=ids)

    async def _chat(self, session: aiohttp.ClientSession, fate: Fate) -> None:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.7,
                "messages": [{"role": "user", "content": self._prompt(fate)}]}
        async with session.post(f"{self.base_url}/chat/completions", json=body) as response:
            fate.status = response.status
            payload = await response.read()
            if not _answered_ok(fate, response.status, payload):
                return
            choice = json.loads(payload)["choices"][0]
            fate.outcome = "completed" if choice.get("finish_reason") else "unexpected"
            if fate.outcome == "unexpected":
                fate.detail = f"no finish_reason: {payload[:300]!r}"

    async def _bad(self, session: aiohttp.ClientSession, fate: Fate) -> None:
        path, raw = self.rng.choice(self.bad)
        async with session.post(f"{self.base_url}{path}", data=raw,
                                headers={"Content-Type": "application/json"}) as response:
            fate.status = response.status
            payload = await response.read()
        if 400 <= response.status < 500 and response.status != 429:
            fate.outcome = "rejected"
            return
        _answered_ok(fate, response.status, payload)  # 5xx and 429 as for any request
        if not fate.outcome:
            fate.outcome = "unexpected"
            fate.detail = f"{path} {raw[:120]!r} answered {response.status}"


async def _head(response: aiohttp.ClientResponse) -> bytes:
    """The body of a refused request (empty for a 200, whose stream is read after)."""
    return b"" if response.status == 200 else await response.read()


def _answered_ok(fate: Fate, status: int, payload: bytes) -> bool:
    """True for a 200; otherwise sets the fate a good request gets for `status`."""
    if status == 200:
        return True
    fate.detail = payload[:300].decode(errors="replace")
    fate.outcome = ("overloaded" if status == 429 else "server_error" if status >= 500
                    else "unexpected")
    return False


def tally(fates: list[Fate]) -> dict[str, int]:
    """Requests per outcome."""
    counts: dict[str, int] = {}
    for fate in fates:
        counts[fate.outcome] = counts.get(fate.outcome, 0) + 1
    return dict(sorted(counts.items()))
