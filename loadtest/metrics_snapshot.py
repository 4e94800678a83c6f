"""Scrapes of every service's metrics, and the report of loadtest/gpu_metrics.sh.

Driver part: `metrics`.

    python loadtest/metrics_snapshot.py --up-output UP_OUT --out snap.json [--time-scrapes]
    python loadtest/metrics_snapshot.py --report --run-dir RUN --out metrics.json --summary t.md

A snapshot holds, per service named in `meshserve up`'s output ("metrics NAME: URL"), the
value of every vllm:/meshserve: sample (keyed `name{label=value,...}`); with
--time-scrapes also how long each scrape, and the gateway's merged /metrics/all, took and
how many bytes they were. The report compares the snapshots around the benchmark runs
(before, middle, after) with the benchmark's own figures.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_LINE = re.compile(r"^metrics ([\w-]+|all \(merged\)): (http\S+)$")


def targets(up_output: Path) -> dict[str, str]:
    """Service name -> metrics URL, from `meshserve up`'s printed lines ("all": merged)."""
    found = {}
    for line in up_output.read_text().splitlines():
        match = _LINE.match(line.strip())
        if match:
            found["all" if match.group(1).startswith("all") else match.group(1)] = match.group(2)
    return found


def fetch(url: str) -> tuple[str, float]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=20) as response:
        text = response.read().decode()
    return text, time.perf_counter() - started


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(("vllm:", "meshserve:")):
            continue
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def snapshot(up_output: Path, time_scrapes: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"unix_s": time.time(), "services": {}, "scrapes": {}}
    for name, url in targets(up_output).items():
        text, seconds = fetch(url)
        if name != "all":
            result["services"][name] = samples(text)
        if time_scrapes:
            result["scrapes"][name] = {"seconds": round(seconds, 4), "bytes": len(text)}
    return result


def total(snap: dict[str, Any], service: str, name: str, **labels: str) -> float:
    """Sum of the service's samples called `name` whose labels include `labels`."""
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(v for key, v in snap["services"].get(service, {}).items()
               if key.split("{", 1)[0] == name and all(w in key for w in want))


def report(run: Path) -> dict[str, Any]:
    snaps = {n: json.loads((run / f"{n}.json").read_text())
             for n in ("before", "middle", "after", "during") if (run / f"{n}.json").exists()}
    bench = {n: json.loads((run / f"{n}.json").read_text()) for n in ("sharegpt", "prefix")
             if (run / f"{n}.json").exists()}
    out: dict[str, Any] = {"scrapes_under_load": snaps.get("during", {}).get("scrapes", {})}
    worker = next((s for s in snaps["before"]["services"] if s.startswith("worker")), "worker-0")

    def grew(a: str, b: str, service: str, name: str, **labels: str) -> float:
        return total(snaps[b], service, name, **labels) - total(snaps[a], service, name,
                                                                 **labels)

    def mean(a: str, b: str, service: str, name: str, scale: float = 1e3) -> float | None:
        """Mean of a histogram's observations between two snapshots (x scale: ms)."""
        count = grew(a, b, service, f"{name}_count")
        return round(scale * grew(a, b, service, f"{name}_sum") / count, 2) if count else None

    for run_name, (a, b) in (("sharegpt", ("before", "middle")), ("prefix", ("middle", "after"))):
        if b not in snaps:
            continue
        fig: dict[str, Any] = {
            "bench_completed": bench.get(run_name, {}).get("completed"),
            "bench_output_tokens": bench.get(run_name, {}).get("total_output_tokens"),
            "bench_mean_ttft_ms": bench.get(run_name, {}).get("mean_ttft_ms"),
            "bench_mean_itl_ms": bench.get(run_name, {}).get("mean_itl_ms"),
            "worker_generation_tokens": grew(a, b, worker, "vllm:generation_tokens_total"),
            "gateway_generation_tokens": grew(a, b, "gateway", "vllm:generation_tokens_total"),
            "worker_requests_finished": grew(a, b, worker, "vllm:request_success_total"),
            "preemptions": grew(a, b, worker, "vllm:num_preemptions_total"),
        }
        queries = grew(a, b, worker, "vllm:prefix_cache_queries_total")
        fig["prefix_cache_hit_rate"] = round(
            grew(a, b, worker, "vllm:prefix_cache_hits_total") / queries, 4) if queries else None
        for key, name in (("ttft", "vllm:time_to_first_token_seconds"),
                          ("itl", "vllm:inter_token_latency_seconds"),
                          ("e2e", "vllm:e2e_request_latency_seconds")):
            fig[f"worker_mean_{key}_ms"] = mean(a, b, worker, name)
            fig[f"gateway_mean_{key}_ms"] = mean(a, b, "gateway", name)
        for key, name in (("queue", "vllm:request_queue_time_seconds"),
                          ("prefill", "vllm:request_prefill_time_seconds"),
                          ("decode", "vllm:request_decode_time_seconds")):
            fig[f"worker_mean_{key}_ms"] = mean(a, b, worker, name)
        fig["worker_mean_tokens_per_step"] = mean(a, b, worker, "vllm:iteration_tokens_total", 1)
        out[run_name] = fig
    during = snaps.get("during", {})
    if during:
        out["during_sharegpt"] = {
            name: total(during, worker, name) for name in (
                "vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc")}
    return out


def summary(result: dict[str, Any]) -> str:
    lines = ["| figure | sharegpt-like, all at once | prefix-heavy |", "|---|---|---|"]
    keys = list(dict.fromkeys(k for run in ("sharegpt", "prefix") for k in result.get(run, {})))
    for key in keys:
        cells = [str(result.get(run, {}).get(key, "")) for run in ("sharegpt", "prefix")]
        lines.append(f"| {key} | {' | '.join(cells)} |")
    lines += ["", "| scrape under load | seconds | bytes |", "|---|---|---|"]
    for name, s in result.get("scrapes_under_load", {}).items():
        lines.append(f"| {name} | {s['seconds']} | {s['bytes']} |")
    for name, value in result.get("during_sharegpt", {}).items():
        lines.append(f"\n{name} during the sharegpt-like run: {value}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--up-output", type=Path, help="`meshserve up`'s stdout")
    parser.add_argument("--time-scrapes", action="store_true")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summary", type=Path)
    args = parser.parse_args(argv)
    if args.report:
        result = report(args.run_dir)
        args.out.write_text(json.dumps(result, indent=2))
        if args.summary:
            args.summary.write_text(summary(result))
        return 0
    args.out.write_text(json.dumps(snapshot(args.up_output, args.time_scrapes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
