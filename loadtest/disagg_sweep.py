"""The summary of a disaggregated-serving sweep: one prefill + one decode worker against two
mixed workers, each at a sweep of request rates of long prompts (`meshserve bench serve`
result JSONs, DIR/CONFIG/rate_R.json, and every service's /metrics at the end of each
config, DIR/CONFIG/metrics.json from loadtest/metrics_snapshot.py).

Driver part: `disagg`.

    python loadtest/disagg_sweep.py DIR --configs mixed disagg --rates 1 2 3 4 6 \
        --num-prompts 40 [--ttft-slo-ms 2000 --itl-slo-ms 50] --out summary.md --json s.json

A run meets the SLOs when every one of its requests completed, its TTFT p90 is at most
--ttft-slo-ms and its ITL p99 (every inter-token gap of every request) at most --itl-slo-ms.
A config's goodput is the highest swept rate whose run meets them (none when no run does).
The report: per config a row per rate (TTFT p50/p90, ITL p50/p99, TPOT, the bench's
per-request `request_goodput`, failures, whether the run met the SLOs), each config's
goodput, the goodput ratio of the second config over the first and the second's ITL p99 over
the first's at the first config's goodput rate (both undefined, and said so, where a goodput
is missing), the per-rate latency ratios, and the KV handoff counters each worker reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LABELS = {"mixed": "2 mixed workers", "disagg": "1 prefill + 1 decode"}
# The bench's figures a row shows, under vLLM's result names.
FIELDS = ("median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
          "request_goodput", "request_throughput", "completed", "failed")
HANDOFF_MARK = "kv_handoff"
HEADER = ("| rate (req/s) | TTFT p50 | TTFT p90 | ITL p50 | ITL p99 | TPOT mean | "
          "request_goodput | req/s done | completed | failed | meets SLOs |")
NO_RESULT = "no result (failed, timed out or skipped: see CONFIG/steps.log)"
NO_HANDOFF = "KV handoff counters: none reported (no handoff in this config, or no metrics.json)."


@dataclasses.dataclass(frozen=True)
class Slo:
    """The latency objectives a run must meet, in milliseconds."""

    ttft_p90_ms: float
    itl_p99_ms: float


@dataclasses.dataclass(frozen=True)
class RateRun:
    """One rate's run of one config: the bench's figures (FIELDS), None when it left no
    result (it failed, timed out or was skipped for lack of time)."""

    rate: str
    figures: dict[str, Any] | None

    def meets(self, slo: Slo) -> bool:
        """Every request completed, TTFT p90 and ITL p99 within the SLOs."""
        f = self.figures
        return (f is not None and f["failed"] == 0 and f["completed"] > 0
                and f["p90_ttft_ms"] <= slo.ttft_p90_ms and f["p99_itl_ms"] <= slo.itl_p99_ms)


def load_runs(config_dir: Path, rates: Sequence[str]) -> list[RateRun]:
    """The runs of one config, in `rates` order (the per-request arrays left out)."""
    runs = []
    for rate in rates:
        path = config_dir / f"rate_{rate}.json"
        figures = None
        if path.is_file():
            result = json.loads(path.read_text(encoding="utf-8"))
            figures = {key: result.get(key) for key in FIELDS}
        runs.append(RateRun(rate, figures))
    return runs


def goodput(runs: Sequence[RateRun], slo: Slo) -> str | None:
    """The highest rate whose run met the SLOs; None when none did."""
    met = [run.rate for run in runs if run.meets(slo)]
    return max(met, key=float) if met else None


def handoff_counters(metrics_path: Path) -> dict[str, dict[str, float]]:
    """Per service, its KV handoff samples (meshserve:kv_handoff_*) at the end of the run."""
    if not metrics_path.is_file():
        return {}
    services = json.loads(metrics_path.read_text(encoding="utf-8")).get("services", {})
    found = {name: {key: value for key, value in samples.items() if HANDOFF_MARK in key}
             for name, samples in services.items()}
    return {name: samples for name, samples in found.items() if samples}


def _figure(runs: Sequence[RateRun], rate: str, key: str) -> float | None:
    run = next((r for r in runs if r.rate == rate), None)
    return None if run is None or run.figures is None else run.figures[key]


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or bottom is None or bottom == 0 else top / bottom


def goodput_ratio(base: str | None, other: str | None) -> tuple[float | None, str]:
    """The other config's goodput over the base's, and what the number means (or why there is
    none)."""
    if base is None and other is None:
        return None, "undefined: no rate met the SLOs in either config"
    if base is None:
        return None, f"undefined: the first config met the SLOs at no rate (the second: {other})"
    if other is None:
        return 0.0, "the second config met the SLOs at no rate"
    return float(other) / float(base), f"{other} over {base} req/s"


def itl_ratio(base_runs: Sequence[RateRun], other_runs: Sequence[RateRun],
              base_goodput: str | None) -> tuple[float | None, str]:
    """The other config's ITL p99 over the base's at the base's goodput rate."""
    if base_goodput is None:
        return None, "undefined: the first config met the SLOs at no rate"
    other = _figure(other_runs, base_goodput, "p99_itl_ms")
    if other is None:
        return None, f"undefined: the second config has no result at {base_goodput} req/s"
    base = _figure(base_runs, base_goodput, "p99_itl_ms")
    return _ratio(other, base), f"at {base_goodput} req/s: {other:.2f} over {base:.2f} ms"


def summarize(root: Path, configs: Sequence[str], rates: Sequence[str], slo: Slo,
              num_prompts: int | None = None) -> dict[str, Any]:
    """Every figure of the report (what --json writes)."""
    runs = {config: load_runs(root / config, rates) for config in configs}
    out: dict[str, Any] = {"slo": dataclasses.asdict(slo), "num_prompts": num_prompts,
                           "rates": list(rates), "configs": {}}
    for config, config_runs in runs.items():
        out["configs"][config] = {
            "label": LABELS.get(config, config), "goodput": goodput(config_runs, slo),
            "runs": [{"rate": r.rate, "meets_slo": r.meets(slo), "figures": r.figures}
                     for r in config_runs],
            "kv_handoff": handoff_counters(root / config / "metrics.json")}
    if len(configs) == 2:
        base, other = configs
        good = (out["configs"][base]["goodput"], out["configs"][other]["goodput"])
        out["goodput_ratio"], out["goodput_ratio_note"] = goodput_ratio(*good)
        out["itl_p99_ratio"], out["itl_p99_ratio_note"] = itl_ratio(runs[base], runs[other],
                                                                    good[0])
        out["per_rate_ratios"] = {rate: {
            key: _ratio(_figure(runs[other], rate, key), _figure(runs[base], rate, key))
            for key in ("p90_ttft_ms", "p99_itl_ms")} for rate in rates}
    return out


def _cell(value: Any, template: str = "{:.1f}") -> str:
    if value is None:
        return "n/a"
    return template.format(value) if isinstance(value, float) else str(value)


def _config_table(config: dict[str, Any]) -> list[str]:
    lines = [HEADER, "|---" * HEADER.count(" | ") + "|---|"]
    for run in config["runs"]:
        f = run["figures"]
        if f is None:
            cells = [NO_RESULT, *[""] * (len(FIELDS) - 1)]
        else:
            cells = [_cell(f[k]) for k in FIELDS[:5]] + [_cell(f[k], "{:.2f}") for k in FIELDS[5:]]
        met = "yes" if run["meets_slo"] else "no"
        lines.append(f"| {run['rate']} | " + " | ".join(cells) + f" | {met} |")
    return lines


def _handoff_lines(counters: dict[str, dict[str, float]]) -> list[str]:
    if not counters:
        return [NO_HANDOFF]
    lines = ["KV handoff counters at the end of the run:", ""]
    for service, samples in counters.items():
        lines += [f"- {service}: " + ", ".join(f"`{k}` {v:g}" for k, v in samples.items())]
    return lines


def _ratio_lines(summary: dict[str, Any]) -> list[str]:
    base, other = summary["configs"]
    good = _cell(summary["goodput_ratio"], "{:.2f}")
    itl = _cell(summary["itl_p99_ratio"], "{:.2f}")
    itl_line = (f"- ITL p99 ratio at the first config's goodput rate: {itl} "
                f"({summary['itl_p99_ratio_note']}; target <= 0.5)")
    lines = [f"## {other} against {base}", "",
             f"- goodput ratio: {good} ({summary['goodput_ratio_note']}; target >= 1.5)",
             itl_line, "",
             f"| rate (req/s) | TTFT p90 {other}/{base} | ITL p99 {other}/{base} |",
             "|---|---|---|"]
    for rate, ratios in summary["per_rate_ratios"].items():
        lines.append(f"| {rate} | {_cell(ratios['p90_ttft_ms'], '{:.2f}')} | "
                     f"{_cell(ratios['p99_itl_ms'], '{:.2f}')} |")
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The report as markdown (latencies in ms)."""
    slo = summary["slo"]
    intro = (f"SLOs: TTFT p90 <= {slo['ttft_p90_ms']:g} ms, ITL p99 <= {slo['itl_p99_ms']:g} "
             "ms, no failed request; goodput = the highest rate meeting them. "
             f"{summary['num_prompts'] or '?'} long-prompt requests per rate. request_goodput: "
             "the bench's per-request goodput (TTFT and TPOT within the SLOs), for reference.")
    lines = [f"# Disaggregated serving sweep: {', '.join(summary['configs'])}", "", intro, ""]
    for name, config in summary["configs"].items():
        good = config["goodput"]
        lines += [f"## {name}: {config['label']}", "", *_config_table(config), "",
                  f"Goodput: {good + ' req/s' if good else 'none (no rate met the SLOs)'}.",
                  "", *_handoff_lines(config["kv_handoff"]), ""]
    if "goodput_ratio_note" in summary:
        lines += _ratio_lines(summary)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the part's folder, one subfolder per config")
    parser.add_argument("--configs", nargs="+", default=["mixed", "disagg"],
                        help="configs in order; ratios are the second over the first")
    parser.add_argument("--rates", nargs="+", required=True, help="the swept rates, as named "
                                                                  "in rate_R.json")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=50.0)
    parser.add_argument("--out", type=Path, default=None, help="the markdown report")
    parser.add_argument("--json", type=Path, default=None, help="every figure as JSON")
    args = parser.parse_args(argv)
    summary = summarize(args.root, args.configs, args.rates,
                        Slo(args.ttft_slo_ms, args.itl_slo_ms), args.num_prompts)
    write_report(markdown(summary), summary, args.out, args.json)


def write_report(text: str, summary: dict[str, Any], out: Path | None,
                 json_out: Path | None) -> None:
    """The markdown to `out` and the figures to `json_out` (each when given), the markdown
    to stdout too."""
    if out is not None:
        out.write_text(text, encoding="utf-8")
    if json_out is not None:
        json_out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
