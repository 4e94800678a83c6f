"""Running the benchmark: arrivals, the concurrency cap, warm-up, one run per sweep point.

    results = await run_benchmark(config, workload)   # one result dict per concurrency

Requests arrive as vLLM's `--request-rate`/`--burstiness` define: the first at once, then
gaps drawn from gamma(shape=burstiness, scale=1/(rate x burstiness)) (mean 1/rate; burstiness
1 is a Poisson process, lower is burstier), all at once for an infinite rate. A request that
arrives while `max_concurrency` others are in flight waits for one to finish; its latency
counts from when it is sent.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import orjson
from tqdm import tqdm

from meshserve.bench.serve.client import (
    OpenAIClient,
    RequestInput,
    RequestResult,
    error_message,
    open_session,
)
from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.metrics import run_result
from meshserve.bench.serve.workload import Workload
from meshserve.shared.errors import AuthenticationError, UnavailableError

# The SeedSequence word of the arrival draws (the prompts use others).
_ARRIVALS_STREAM = 4
# How long the start-up check of the server may take.
_PREFLIGHT_TIMEOUT_S = 10.0


def arrival_offsets(count: int, request_rate: float, burstiness: float, seed: int
                    ) -> np.ndarray:
    """Seconds after the start at which each request is sent (vLLM's gamma arrivals)."""
    if math.isinf(request_rate):
        return np.zeros(count)
    rng = np.random.default_rng((seed, _ARRIVALS_STREAM))
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1])))


async def run_requests(client: OpenAIClient, requests: Sequence[RequestInput], *,
                       offsets: np.ndarray, max_concurrency: int | None, progress: bool
                       ) -> tuple[list[RequestResult], float]:
    """Send every request at its offset under the cap; (outputs in input order, seconds
    from the first arrival to the last completion)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, unit="req",
               dynamic_ncols=True)

    async def one(request: RequestInput) -> RequestResult:
        if slots is None:
            output = await client.send(request)
        else:
            async with slots:
                output = await client.send(request)
        bar.update(1)
        return output

    with bar:
        started = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets.tolist(), strict=True):
            wait = started + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(request)))
        outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - started


async def server_model(session: aiohttp.ClientSession, config: ServeConfig) -> str:
    """The model to name: --model, else the first of GET /v1/models. Checks first that the
    server answers, so that a server that is down fails at once with a clear error."""
    url = config.base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with asyncio.timeout(_PREFLIGHT_TIMEOUT_S):
            async with session.get(url, headers=headers) as resp:
                status, body = resp.status, await resp.read()
    except TimeoutError as exc:
        raise UnavailableError(f"{url} did not answer within {_PREFLIGHT_TIMEOUT_S:g}s") from exc
    except aiohttp.ClientError as exc:
        raise UnavailableError(f"cannot reach {config.base_url}: {exc}") from exc
    if status in (401, 403):
        raise AuthenticationError(f"{url} answered {status} ({error_message(body)}): check "
                                  f"--api-key")
    if config.model is not None:
        return config.model  # a server without /v1/models is fine when the model is named
    if status != 200:
        raise UnavailableError(f"{url} answered {status} ({error_message(body)}); name the "
                               f"model with --model")
    try:
        return str(orjson.loads(body)["data"][0]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise UnavailableError(f"{url} lists no model ({body[:200]!r}); name the model with "
                               f"--model") from exc


async def warm_up(client: OpenAIClient, warmup: Sequence[RequestInput], cap: int | None
                  ) -> None:
    """Untimed requests; UnavailableError when every one of them failed."""
    if not warmup:
        return
    outputs, _ = await run_requests(client, warmup, offsets=np.zeros(len(warmup)),
                                    max_concurrency=cap, progress=False)
    if not any(o.success for o in outputs):
        first = outputs[0]
        raise UnavailableError(f"every warm-up request failed; the first: status "
                               f"{first.status}, {first.error}")


async def run_benchmark(config: ServeConfig, workload: Workload) -> list[dict[str, Any]]:
    """Warm up, then run the prompts once per concurrency; one result per run."""
    caps = config.concurrencies
    limit = 0 if None in caps else max(c for c in caps if c is not None)
    slos = config.goodput_slos_ms
    async with open_session(limit) as session:
        model = await server_model(session, config)
        client = OpenAIClient(session, config.url, model=model, endpoint=config.endpoint,
                              api_key=config.api_key, ignore_eos=config.ignore_eos,
                              temperature=config.temperature, timeout_s=config.timeout_s)
        await warm_up(client, workload.warmup, caps[0])
        offsets = arrival_offsets(len(workload.requests), config.request_rate,
                                  config.burstiness, config.seed)
        results = []
        for cap in caps:
            outputs, duration = await run_requests(client, workload.requests, offsets=offsets,
                                                   max_concurrency=cap,
                                                   progress=config.progress)
            result = run_result(outputs, duration, slos or None, config.percentiles)
            result.update(model=model, max_concurrency=cap,
                          request_rate="inf" if math.isinf(config.request_rate)
                          else config.request_rate, burstiness=config.burstiness)
            results.append(result)
    return results
