"""Where a burst's requests spent their time before the engine, hop by hop, from the spans
that every service exported (loadtest/otlp_sink.py's JSON lines).

Driver part: `mesh` (VARIANTS=traced).

    python loadtest/trace_hops.py SPANS.jsonl [--skip S --count N] [--out hops.json]

Takes N traces with a gateway `POST /v1/completions` span after the first S, in the order
they reached the gateway (default: the second half of them, a timed burst after a warm-up
of the same size), and prints, over them, p10 / p50 / p90 / max in
ms of: when each request reached the gateway after the burst's first; the gateway's
`tokenize` and `route` spans and the scheduler's `Route` (a request the scheduler holds in
its global queue shows there); from the gateway's start to the worker's `worker.queue`
span (the request in the worker); the time in the worker's queue before its prefill; and
when each request reached the worker after the burst's first reached the gateway.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

POST = ("gateway", "POST /v1/completions")
SPANS = {"tokenize (gateway)": ("gateway", "tokenize"), "route (gateway)": ("gateway", "route"),
         "route (scheduler)": ("scheduler", "meshserve.v1.Scheduler/Route"),
         "worker queue": ("worker", "worker.queue")}


def traces(path: Path) -> list[dict[tuple[str, str], dict[str, Any]]]:
    """Each trace's spans by (service, name), traces with a completion POST, in POST order."""
    by_trace: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            span = json.loads(line)
            by_trace.setdefault(span["trace_id"], {})[(span["service"], span["name"])] = span
    posts = [t for t in by_trace.values() if POST in t]
    return sorted(posts, key=lambda t: t[POST]["start_unix_nano"])


def hops(burst: list[dict[tuple[str, str], dict[str, Any]]]) -> dict[str, list[float]]:
    """Per figure, one value in ms per request of `burst` that has the spans it needs."""
    first = min(t[POST]["start_unix_nano"] for t in burst)
    figures: dict[str, list[float]] = {"at the gateway, after the first": []}
    for trace in burst:
        post = trace[POST]
        figures["at the gateway, after the first"].append((post["start_unix_nano"] - first) / 1e6)
        for label, key in SPANS.items():
            if key in trace:
                span = trace[key]
                figures.setdefault(label, []).append(
                    (span["end_unix_nano"] - span["start_unix_nano"]) / 1e6)
        queue = trace.get(SPANS["worker queue"])
        if queue is not None:
            figures.setdefault("gateway to worker", []).append(
                (queue["start_unix_nano"] - post["start_unix_nano"]) / 1e6)
            figures.setdefault("in the worker, after the first reached the gateway",
                               []).append((queue["start_unix_nano"] - first) / 1e6)
    return figures


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p10": at(0.1), "p50": at(0.5), "p90": at(0.9), "max": round(ordered[-1], 1),
            "count": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spans", type=Path)
    parser.add_argument("--skip", type=int, default=None,
                        help="requests before the burst (default: half of the POSTs)")
    parser.add_argument("--count", type=int, default=None,
                        help="requests of the burst (default: all after --skip)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    posts = traces(args.spans)
    skip = len(posts) // 2 if args.skip is None else args.skip
    burst = posts[skip:None if args.count is None else skip + args.count]
    if not burst:
        raise SystemExit(f"no completion traces in {args.spans}")
    summary = {label: percentiles(values) for label, values in hops(burst).items()}
    for label, figures in summary.items():
        print(f"{label:52s} " + " ".join(f"{k} {v:>8}" for k, v in figures.items()))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
