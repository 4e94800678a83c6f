"""loadtest/trace_hops.py: a burst's per-hop times from exported spans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest_scripts import LOADTEST, load_script

trace_hops = load_script("trace_hops")
_SCRIPT = LOADTEST / "trace_hops.py"

MS = 1_000_000


def _span(trace: int, service: str, name: str, start_ms: float, end_ms: float) -> dict:
    return {"trace_id": f"{trace:032x}", "span_id": f"{trace:08x}{len(name):08x}",
            "parent_span_id": "", "service": service, "name": name,
            "start_unix_nano": int(start_ms * MS), "end_unix_nano": int(end_ms * MS)}


def _request(trace: int, at_ms: float, queued_ms: float) -> list[dict]:
    """One request: gateway at `at_ms`, held `queued_ms` in the scheduler's Route."""
    return [_span(trace, "gateway", "POST /v1/completions", at_ms, at_ms + 500),
            _span(trace, "gateway", "route", at_ms + 1, at_ms + 2 + queued_ms),
            _span(trace, "scheduler", "meshserve.v1.Scheduler/Route", at_ms + 1.5,
                  at_ms + 1.5 + queued_ms),
            _span(trace, "worker", "worker.queue", at_ms + 3 + queued_ms,
                  at_ms + 13 + queued_ms)]


def test_the_second_burst_is_measured_hop_by_hop(tmp_path: Path) -> None:
    spans = [s for i in range(4) for s in _request(i, 100.0 * i, 0.0)]  # a warm-up burst
    # The timed burst: four requests 10 ms apart, the last two held 400 ms by the scheduler.
    spans += [s for i in range(4) for s in _request(10 + i, 1000.0 + 10 * i,
                                                    400.0 if i >= 2 else 0.0)]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in reversed(spans)))
    burst = trace_hops.traces(path)[4:]
    figures = trace_hops.hops(burst)
    assert figures["at the gateway, after the first"] == [0.0, 10.0, 20.0, 30.0]
    assert figures["route (scheduler)"] == [0.0, 0.0, 400.0, 400.0]
    assert figures["gateway to worker"] == [3.0, 3.0, 403.0, 403.0]
    assert figures["in the worker, after the first reached the gateway"] == [
        3.0, 13.0, 423.0, 433.0]
    assert trace_hops.percentiles(figures["route (scheduler)"]) == {
        "p10": 0.0, "p50": 400.0, "p90": 400.0, "max": 400.0, "count": 4}
    out = tmp_path / "hops.json"
    run = subprocess.run([sys.executable, str(_SCRIPT), str(path), "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert "route (scheduler)" in run.stdout
    assert json.loads(out.read_text())["gateway to worker"]["max"] == 403.0
