"""1000 requests at once against a running stack: completed, refused (429) and how fast.

Driver part: none (run by hand against `meshserve up`; cited by docs/operations.md).

    meshserve up --workers 2 &                      # the default bounds
    python loadtest/admission.py --out loadtest/reports/cpu/admission.json

`--warmup` requests run first, a few at a time, so that the scheduler has seen requests end
(without that it has no service time and no estimate: docs/operations.md, "Overload").
Then `--requests` streamed completions (`--max-tokens` tokens each, `ignore_eos`) are sent at
once, each on its own connection. Reported: the count per status, the refusals' latency
(p50, p99, max; each should be well under a second) and their Retry-After values, and for
the admitted requests the wait to start (time to the first streamed chunk: the answer's
headers go out with it) and the end-to-end latency; the p99 wait should stay within the
gateway's --max-queue-delay-s (60 s by default). Other failures (5xx, connection errors,
cut streams) are counted apart, each with its message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp


@dataclass
class Outcome:
    """What one request got."""

    status: int  # HTTP status; 0: no answer (connection error)
    seconds: float  # sending to the end of the answer
    first_chunk_s: float | None = None  # sending to the first streamed chunk (200 only)
    retry_after: str | None = None
    complete: bool = False  # a 200 stream that ended with [DONE]
    error: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 3) if ordered else None
    return {"count": len(ordered), "p50_s": at(0.5), "p99_s": at(0.99),
            "max_s": round(ordered[-1], 3) if ordered else None}


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int,
               max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": f"Request {i}: write about the sea.", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    sent = time.monotonic()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = await response.text()
                return Outcome(response.status, time.monotonic() - sent,
                               retry_after=response.headers.get("Retry-After"),
                               error="" if response.status == 429 else text[:200])
            first: float | None = None
            done = False
            async for line in response.content:
                if first is None and line.startswith(b"data:"):
                    first = time.monotonic() - sent
                done = done or line.strip() == b"data: [DONE]"
            return Outcome(200, time.monotonic() - sent, first, complete=done,
                           error="" if done else "stream ended without [DONE]")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(0, time.monotonic() - sent, error=f"{type(exc).__name__}: {exc}")


async def _model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/models") as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def run(base_url: str, requests: int, max_tokens: int, warmup: int,
              timeout_s: float) -> dict[str, object]:
    """The warm-up, then the burst; the report of the burst."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await _model(session, base_url)
        url = f"{base_url}/completions"
        for start in range(0, warmup, 4):
            await asyncio.gather(*(_one(session, url, model, -1 - i, max_tokens)
                                   for i in range(start, min(start + 4, warmup))))
        began = time.monotonic()
        outcomes = await asyncio.gather(*(_one(session, url, model, i, max_tokens)
                                          for i in range(requests)))
        wall = time.monotonic() - began
    return report(list(outcomes), model=model, max_tokens=max_tokens, warmup=warmup,
                  wall_s=wall)


def report(outcomes: list[Outcome], **settings: object) -> dict[str, object]:
    """Counts and latencies of a burst's outcomes."""
    refused = [o for o in outcomes if o.status == 429]
    admitted = [o for o in outcomes if o.status == 200]
    failed = [o for o in outcomes if o.status not in (200, 429) or o.error]
    return {
        "settings": settings, "host": platform.node(), "requests": len(outcomes),
        "statuses": dict(Counter(str(o.status) for o in outcomes)),
        "completed": sum(o.complete for o in admitted),
        "refused": len(refused),
        "refusal_latency": _percentiles([o.seconds for o in refused]),
        "refusals_over_1s": sum(o.seconds >= 1.0 for o in refused),
        "retry_after": dict(Counter(o.retry_after or "missing" for o in refused)),
        "admitted_wait": _percentiles([o.first_chunk_s for o in admitted
                                       if o.first_chunk_s is not None]),
        "admitted_e2e": _percentiles([o.seconds for o in admitted]),
        "failures": [{"status": o.status, "error": o.error} for o in failed][:50],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8,
                        help="requests run first, 4 at a time (0: a cold burst)")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="longest one request may take")
    parser.add_argument("--out", type=Path, help="write the report here as JSON")
    args = parser.parse_args()
    result = asyncio.run(run(args.base_url.rstrip("/"), args.requests, args.max_tokens,
                             args.warmup, args.timeout_s))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
