"""Check that every query of a Grafana dashboard returns data from a Prometheus server.

    python compose/check_dashboard.py --prometheus http://127.0.0.1:9090 \
        [--dashboard compose/grafana/dashboards/meshserve.json] [--rate-interval 1m]

For every panel (rows included) and every PromQL target, the dashboard's variables are
filled in (`$__rate_interval` and `$__interval` with --rate-interval, any other `$var` with
`.*`, as its "All" value), the query goes to the server's /api/v1/query, and a panel target
whose result is empty (or fails) is reported. Exit status 0 when every one returned data,
1 otherwise, with the empty ones listed. Standard library only: it runs anywhere Python does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "meshserve.json"
# A metric name in PromQL: the mesh's own and vLLM's namespaces.
_METRIC = re.compile(r"\b((?:vllm|meshserve):[a-zA-Z_:][a-zA-Z0-9_:]*)")
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


@dataclass(frozen=True)
class Target:
    """One PromQL query of one panel."""

    panel: str
    ref_id: str
    expr: str


def panel_targets(dashboard: dict[str, Any]) -> Iterator[Target]:
    """Every PromQL target of every panel, panels inside rows included."""
    def walk(panels: list[dict[str, Any]]) -> Iterator[Target]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield Target(panel.get("title", "?"), target.get("refId", "?"),
                                 target["expr"])
    yield from walk(dashboard.get("panels", []))


def metric_names(expr: str) -> set[str]:
    """The vllm:/meshserve: metric names a query reads (series names, suffixes included)."""
    return set(_METRIC.findall(expr))


def fill_variables(expr: str, rate_interval: str) -> str:
    """The query as Grafana would send it with every variable on its "All" value."""
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return rate_interval if name in ("__rate_interval", "__interval", "__range") else ".*"
    return _VARIABLE.sub(value, expr)


def query(prometheus: str, expr: str) -> list[Any]:
    """The result vector of an instant query (raises on an error answer)."""
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.loads(response.read())
    if body.get("status") != "success":
        raise RuntimeError(body.get("error", body))
    return body["data"]["result"]


def check(dashboard: dict[str, Any], prometheus: str, rate_interval: str) -> list[str]:
    """One line per target that returned no data (empty: all did); prints every result."""
    empty = []
    for target in panel_targets(dashboard):
        expr = fill_variables(target.expr, rate_interval)
        try:
            result = query(prometheus, expr)
            problem = "" if result else "no data"
        except (OSError, RuntimeError, ValueError) as exc:
            result, problem = [], f"query failed: {exc}"
        print(f"{'ok ' if not problem else 'EMPTY'} {len(result):3d} series  "
              f"{target.panel} [{target.ref_id}]")
        if problem:
            empty.append(f"{target.panel} [{target.ref_id}]: {problem}: {expr}")
    return empty


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument("--rate-interval", default="1m",
                        help="what $__rate_interval stands for (default: 1m)")
    args = parser.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    empty = check(dashboard, args.prometheus, args.rate_interval)
    total = sum(1 for _ in panel_targets(dashboard))
    if empty:
        print(f"\n{len(empty)} of {total} panel queries returned no data:", file=sys.stderr)
        for line in empty:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"\nall {total} panel queries returned data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
