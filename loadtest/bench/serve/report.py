"""The printed table and the JSON document of a `meshserve bench serve` run.

One run prints vLLM's result block; a sweep prints one row per concurrency. The JSON holds
the config, the environment and the result (`results`: one per concurrency for a sweep).
"""

from __future__ import annotations

import datetime
import platform
import re
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from meshserve.bench.serve.config import ServeConfig

_WIDTH = 50
_BLOCK_ROWS = (
    ("Successful requests:", "completed", "{}"),
    ("Failed requests:", "failed", "{}"),
    ("Maximum request concurrency:", "max_concurrency", "{}"),
    ("Benchmark duration (s):", "duration", "{:.2f}"),
    ("Total input tokens:", "total_input_tokens", "{}"),
    ("Total generated tokens:", "total_output_tokens", "{}"),
    ("Prompt tokens from cache:", "total_cached_tokens", "{}"),
    ("Cached fraction of prompt tokens:", "cached_token_fraction", "{:.3f}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s):", "request_goodput", "{:.2f}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s):", "total_token_throughput", "{:.2f}"),
)
# Rows left out when the run has no value: no --goodput, or a server that does not report
# cached prompt tokens.
_OPTIONAL_ROWS = ("request_goodput", "total_cached_tokens", "cached_token_fraction")
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
_SWEEP_COLUMNS = (
    ("conc", "max_concurrency", "{}"), ("done", "completed", "{}"), ("fail", "failed", "{}"),
    ("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_throughput", "{:.1f}"),
    ("ttft p50", "median_ttft_ms", "{:.1f}"), ("ttft p99", "p99_ttft_ms", "{:.1f}"),
    ("tpot p50", "median_tpot_ms", "{:.2f}"), ("itl p50", "median_itl_ms", "{:.2f}"),
    ("itl p99", "p99_itl_ms", "{:.2f}"), ("e2el p50", "median_e2el_ms", "{:.0f}"),
    ("goodput", "request_goodput", "{:.2f}"), ("cached", "cached_token_fraction", "{:.3f}"),
)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_info(base_url: str) -> dict[str, Any]:
    """Where the client ran and what it measured."""
    return {"python": platform.python_version(), "platform": platform.platform(),
            "meshserve": _version("meshserve"), "aiohttp": _version("aiohttp"),
            "base_url": base_url,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _cell(template: str, value: Any) -> str:
    if value is None:
        return "-" if template != "{}" else "none"
    return template.format(value)


def _percentile_rows(result: dict[str, Any], metric: str) -> list[tuple[str, str]]:
    """(label, key) of every percentile of `metric` in the result (`p99.9_itl_ms` -> P99.9),
    lowest first: p90 and p99, and those --metric-percentiles added."""
    pattern = re.compile(rf"p(\d+(?:\.\d+)?)_{metric}_ms")
    found = [(float(m.group(1)), m.group(1), key) for key in result
             if (m := pattern.fullmatch(key))]
    return [(f"P{word}", key) for _, word, key in sorted(found)]


def result_block(result: dict[str, Any]) -> str:
    """vLLM's `Serving Benchmark Result` block of one run."""
    rule = "=" * _WIDTH
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    for label, key, template in _BLOCK_ROWS:
        if key in _OPTIONAL_ROWS and result.get(key) is None:
            continue
        lines.append(f"{label:<40}{_cell(template, result[key]):>10}")
    for metric, title in _TITLES.items():
        lines.append(f" {title} ".center(_WIDTH, "-"))
        rows = [("Mean", f"mean_{metric}_ms"), ("Median", f"median_{metric}_ms"),
                *_percentile_rows(result, metric)]
        lines.extend(f"{f'{label} {metric.upper()} (ms):':<40}{result[key]:>10.2f}"
                     for label, key in rows)
    failures = result["failures"]
    if failures["count"]:
        lines.append(" Failures ".center(_WIDTH, "-"))
        lines.extend(f"{f'HTTP {status}:':<40}{count:>10}"
                     for status, count in failures["by_status"].items())
        lines.extend(f"  {count} x {message[:_WIDTH * 2]}"
                     for message, count in list(failures["by_error"].items())[:5])
    lines.append(rule)
    return "\n".join(lines)


def sweep_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per concurrency (latencies in ms)."""
    rows = [[name for name, _, _ in _SWEEP_COLUMNS]]
    rows += [[_cell(template, r[key]) for _, key, template in _SWEEP_COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_SWEEP_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)


def render(results: Sequence[dict[str, Any]], sweep: bool) -> str:
    """The text printed at the end of the run."""
    return sweep_table(results) if sweep else result_block(results[0])


def document(config: ServeConfig, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: a single run's fields at the top level, a sweep's under `results`."""
    head = {"benchmark": "serve", "backend": "openai", "endpoint": config.url,
            "config": config.as_report(), "environment": environment_info(config.base_url)}
    if config.concurrency_sweep is None:
        return {**head, **results[0]}
    return {**head, "concurrencies": list(config.concurrency_sweep), "results": list(results)}


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write `report` (orjson: per-request arrays make it large)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_NON_STR_KEYS) + b"\n")
