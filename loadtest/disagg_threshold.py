"""The measured short-prompt threshold of disaggregated serving (--disagg-min-prompt-tokens).

    python loadtest/disagg_threshold.py DIR --lengths 16 64 256 1024 --out summary.md

Reads the part `disagg`'s short-prompt runs (loadtest/gpu/disagg.sh, CONFIGS="via whole"):
DIR/via/short_L.json, every prompt through the prefill worker, and DIR/whole/short_L.json,
prompts of these lengths run whole on the decode worker, both under the same background of
long-prompt streams. A length goes through the prefill pool when that is faster: its TTFT
p50 is lower there, or running it whole costs the decode worker's streams more than
`--itl-margin` (10%) of ITL p99. The threshold is the shortest length from which every
longer one goes through the prefill pool (none: run every measured length whole).

A second table splits each request's first inter-token gap (first token to second: through
the prefill pool, the handoff and the decode worker taking the request up) from the later
ones: the first gaps' p50 and the later gaps' p99. With 63 gaps a request, a first gap that
long is what ITL p99 through the prefill pool reports; the decision above does not use it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts
from disagg_sweep import write_report

CONFIGS = ("via", "whole")
FIELDS = ("p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "p99_itl_ms", "completed", "failed")


def load(root: Path, config: str, length: str) -> dict[str, Any] | None:
    path = root / config / f"short_{length}.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    return {**{key: result.get(key) for key in FIELDS}, **gaps(result.get("itls") or [])}


def gaps(itls: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """The p50 of the requests' first gaps and the p99 of their later ones (ms; None without
    the bench's per-request `itls`, in seconds)."""
    first = [1000 * row[0] for row in itls if row]
    later = [1000 * gap for row in itls for gap in row[1:]]
    return {"p50_first_gap_ms": statistics.median(first) if first else None,
            "p99_later_itl_ms": (statistics.quantiles(later, n=100, method="inclusive")[98]
                                 if len(later) > 1 else None)}


def via_is_faster(via: dict[str, Any] | None, whole: dict[str, Any] | None,
                  itl_margin: float) -> bool | None:
    """Whether prompts of a length should go through the prefill pool (None: a run missing
    or with failures)."""
    if via is None or whole is None or via["failed"] or whole["failed"]:
        return None
    if via["p50_ttft_ms"] < whole["p50_ttft_ms"]:
        return True
    return bool(whole["p99_itl_ms"] > (1 + itl_margin) * via["p99_itl_ms"])


def threshold(lengths: Sequence[str], verdicts: Sequence[bool | None]) -> str | None:
    """The shortest length from which every longer measured one goes through the prefill
    pool; None when the longest does not (or was not measured)."""
    found = None
    for length, verdict in reversed(list(zip(lengths, verdicts, strict=True))):
        if not verdict:
            break
        found = length
    return found


def summarize(root: Path, lengths: Sequence[str], itl_margin: float) -> dict[str, Any]:
    rows = []
    for length in lengths:
        via, whole = load(root, "via", length), load(root, "whole", length)
        rows.append({"length": length, "via": via, "whole": whole,
                     "through_prefill": via_is_faster(via, whole, itl_margin)})
    return {"itl_margin": itl_margin, "rows": rows,
            "threshold": threshold(lengths, [row["through_prefill"] for row in rows])}


def markdown(summary: dict[str, Any]) -> str:
    def cell(run: dict[str, Any] | None, key: str) -> str:
        return "-" if run is None or run[key] is None else f"{run[key]:.1f}"

    lines = ["# The short-prompt threshold (--disagg-min-prompt-tokens)", "",
             "ms; via: through the prefill worker; whole: run whole on the decode worker.", "",
             ("| prompt tokens | via TTFT p50 | whole TTFT p50 | via TTFT p90 | whole TTFT p90 "
             "| via ITL p99 | whole ITL p99 | through the prefill pool |"),
             "|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        via, whole, verdict = row["via"], row["whole"], row["through_prefill"]
        lines.append(
            f"| {row['length']} | {cell(via, 'p50_ttft_ms')} | {cell(whole, 'p50_ttft_ms')} | "
            f"{cell(via, 'p90_ttft_ms')} | {cell(whole, 'p90_ttft_ms')} | "
            f"{cell(via, 'p99_itl_ms')} | {cell(whole, 'p99_itl_ms')} | "
            f"{'n/a' if verdict is None else 'yes' if verdict else 'no'} |")
    found = summary["threshold"]
    lines += ["", f"Measured threshold: {found} tokens." if found else
              "Measured threshold: none (the longest measured length is faster run whole, "
              "or was not measured).", "",
              "The first gap (first token to second) apart from the later ones, ms:", "",
              ("| prompt tokens | via first gap p50 | whole first gap p50 | via later ITL p99 "
               "| whole later ITL p99 |"), "|---|---|---|---|---|"]
    for row in summary["rows"]:
        via, whole = row["via"], row["whole"]
        lines.append(
            f"| {row['length']} | {cell(via, 'p50_first_gap_ms')} | "
            f"{cell(whole, 'p50_first_gap_ms')} | {cell(via, 'p99_later_itl_ms')} | "
            f"{cell(whole, 'p99_later_itl_ms')} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the part's folder (via/ and whole/ in it)")
    parser.add_argument("--lengths", nargs="+", required=True)
    parser.add_argument("--itl-margin", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = sorted(args.lengths, key=int)
    summary = summarize(args.root, lengths, args.itl_margin)
    write_report(markdown(summary), summary, args.out, args.json)


if __name__ == "__main__":
    main()
