"""A run's figures from its per-request outputs, under vLLM's result field names.

Over the successful requests: TTFT, TPOT (per request, (e2e - ttft) / (output tokens - 1),
for those with more than one token), ITL (every gap, all requests pooled) and E2E latency,
each as mean/median/std/p90/p99 in milliseconds (`mean_ttft_ms`, `p99_itl_ms`, ...;
numpy.percentile, linear between ranks; 0 when there is nothing to measure), plus the
percentiles `--metric-percentiles` asks of the `--percentile-metrics` (`p25_ttft_ms`,
`p99.9_itl_ms`: vLLM's names). Goodput counts
the requests that met every SLO (value <= SLO, vLLM's rule; a one-token request's TPOT is 0).
Prompt-cache hits come from the server's usage (`prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from meshserve.bench.serve.client import RequestResult

MS_PER_S = 1000.0
STATS = ("mean", "median", "std", "p90", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile_key(name: str, percentile: float) -> str:
    """vLLM's key of a percentile: `p99_itl_ms`, `p99.9_itl_ms` (whole numbers without .0)."""
    word = str(int(percentile)) if percentile == int(percentile) else str(percentile)
    return f"p{word}_{name}_ms"


def distribution(name: str, values_s: Iterable[float],
                 percentiles: Sequence[float] = ()) -> dict[str, float]:
    """`{stat}_{name}_ms` for every stat in STATS, and `percentile_key` of each of
    `percentiles`, from values in seconds."""
    ms = np.fromiter(values_s, dtype=float) * MS_PER_S
    wanted = [90.0, 99.0, *percentiles]
    if ms.size == 0:
        return {f"{stat}_{name}_ms": 0.0 for stat in STATS} | {
            percentile_key(name, p): 0.0 for p in wanted}
    median, *values = np.percentile(ms, [50.0, *wanted]).tolist()
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": median,
            f"std_{name}_ms": float(ms.std())} | {
        percentile_key(name, p): value for p, value in zip(wanted, values, strict=True)}


def request_tpot(latency: float, ttft: float, output_tokens: int) -> float:
    """Seconds per output token after the first; 0 for a request of at most one token."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0


def latency_fields(ttfts: Sequence[float], tpots: Sequence[float], itls: Iterable[float],
                   e2els: Sequence[float],
                   percentiles: Mapping[str, Sequence[float]] | None = None
                   ) -> dict[str, float]:
    """The four distributions (seconds in, milliseconds out) under vLLM's names; `percentiles`
    adds percentiles by metric (`{"itl": (99.9,)}`)."""
    extra = percentiles or {}
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    return {k: v for name in METRICS
            for k, v in distribution(name, values[name], extra.get(name, ())).items()}


def is_good(output: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request met every SLO (`{"ttft"|"tpot"|"e2el": ms}`)."""
    values_s = {"ttft": output.ttft, "e2el": output.latency,
                "tpot": request_tpot(output.latency, output.ttft, output.output_tokens)}
    return all(values_s[key] * MS_PER_S <= slo for key, slo in slos_ms.items())


def status_key(output: RequestResult) -> str:
    """The HTTP status of a failure as a key; "no response" when none came."""
    return "no response" if output.status is None else str(output.status)


def failure_summary(outputs: Sequence[RequestResult]) -> dict[str, Any]:
    """Failed requests counted by HTTP status and by error message (most frequent first).
    A mid-stream error event has the stream's status, 200."""
    failed = [o for o in outputs if not o.success]
    return {"count": len(failed),
            "by_status": dict(Counter(status_key(o) for o in failed).most_common()),
            "by_error": dict(Counter(o.error for o in failed).most_common())}


def prompt_cache_fields(ok: Sequence[RequestResult]) -> dict[str, Any]:
    """Prefix-cache hits of successful requests: `total_cached_tokens` (sum of the usage
    `prompt_tokens_details.cached_tokens`) and `cached_token_fraction` (that over the prompt
    tokens of the same requests, the server's count where it gave one). Both None when no
    request reported cached tokens, which is not the same as none cached."""
    reported = [o for o in ok if o.cached_tokens is not None]
    if not reported:
        return {"total_cached_tokens": None, "cached_token_fraction": None}
    cached = sum(o.cached_tokens or 0 for o in reported)
    prompt = sum(o.prompt_len if o.usage_prompt_tokens is None else o.usage_prompt_tokens
                 for o in reported)
    return {"total_cached_tokens": cached,
            "cached_token_fraction": cached / prompt if prompt else 0.0}


def run_result(outputs: Sequence[RequestResult], duration_s: float,
               slos_ms: Mapping[str, float] | None = None,
               percentiles: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """vLLM's serving result of one run: counts, throughputs, latency distributions (with
    `percentiles` by metric besides p90 and p99), goodput (None without SLOs), failures, and
    per-request arrays (seconds; 0 and an empty ITL list for failed requests, whose `errors`
    entry says why)."""
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    tpots = [request_tpot(o.latency, o.ttft, o.output_tokens) for o in ok if o.output_tokens > 1]
    good = sum(is_good(o, slos_ms) for o in ok) if slos_ms else None
    first_start = min((o.start for o in outputs), default=0.0)
    return {
        "duration": duration_s, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **prompt_cache_fields(ok),
        **latency_fields([o.ttft for o in ok], tpots, (t for o in ok for t in o.itl),
                         [o.latency for o in ok], percentiles),
        "failures": failure_summary(outputs),
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft if o.success else 0.0 for o in outputs],
        "itls": [o.itl if o.success else [] for o in outputs],
        "e2els": [o.latency if o.success else 0.0 for o in outputs],
        "cached_tokens": [o.cached_tokens if o.success else None for o in outputs],
        "start_times": [o.start - first_start for o in outputs],
        "statuses": [o.status for o in outputs],
        "errors": [o.error for o in outputs],
    }
