"""The short-prompt threshold's summariser (loadtest/disagg_threshold.py) on result files
written here: a length goes through the prefill pool when its TTFT p50 is lower there or
running it whole costs more than the ITL margin; the threshold is the shortest length from
which every longer one does; a missing or failed run decides nothing; each request's first
gap (the handoff, through the prefill pool) is reported apart from the later ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loadtest_scripts import load_script

threshold = load_script("disagg_threshold")


def write(root: Path, config: str, length: int, ttft: float, itl: float,
          failed: int = 0) -> None:
    folder = root / config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"short_{length}.json").write_text(json.dumps({
        "p50_ttft_ms": ttft, "p90_ttft_ms": ttft * 1.5, "p50_itl_ms": itl / 2,
        "p99_itl_ms": itl, "completed": 40 - failed, "failed": failed}))


def test_the_threshold_is_where_the_prefill_pool_wins_from_then_on(tmp_path: Path) -> None:
    # 16: whole is faster; 64: via wins on ITL only; 256 and 1024: via wins on TTFT.
    for length, via, whole in ((16, (40, 10), (20, 10.5)), (64, (45, 10), (30, 12)),
                               (256, (50, 10), (60, 10)), (1024, (60, 10), (120, 30))):
        write(tmp_path, "via", length, *via)
        write(tmp_path, "whole", length, *whole)
    summary = threshold.summarize(tmp_path, ["16", "64", "256", "1024"], 0.1)
    assert [row["through_prefill"] for row in summary["rows"]] == [False, True, True, True]
    assert summary["threshold"] == "64"
    assert "Measured threshold: 64 tokens." in threshold.markdown(summary)


def test_a_shorter_length_won_by_the_prefill_pool_below_a_lost_one_does_not_count(
        tmp_path: Path) -> None:
    for length, via, whole in ((16, (10, 10), (20, 10)), (64, (45, 10), (30, 10)),
                               (256, (50, 10), (60, 10))):
        write(tmp_path, "via", length, *via)
        write(tmp_path, "whole", length, *whole)
    summary = threshold.summarize(tmp_path, ["16", "64", "256"], 0.1)
    assert summary["threshold"] == "256"


def test_a_missing_or_failed_run_decides_nothing(tmp_path: Path) -> None:
    write(tmp_path, "via", 16, 10, 10)
    write(tmp_path, "whole", 16, 20, 10)
    write(tmp_path, "via", 64, 10, 10, failed=1)
    write(tmp_path, "whole", 64, 20, 10)
    summary = threshold.summarize(tmp_path, ["16", "64", "256"], 0.1)
    assert [row["through_prefill"] for row in summary["rows"]] == [True, None, None]
    assert summary["threshold"] is None
    assert "none" in threshold.markdown(summary)


def test_the_first_gap_is_split_from_the_later_ones(tmp_path: Path) -> None:
    # Through the prefill pool each request's first gap is the handoff (0.4 s here): the
    # later gaps' p99 leaves it out, the ITL p99 the decision uses does not.
    for config, first in (("via", 0.4), ("whole", 0.008)):
        write(tmp_path, config, 16, 20, 400 if config == "via" else 10)
        path = tmp_path / config / "short_16.json"
        result = json.loads(path.read_text())
        # 10 of the 2,520 later gaps (under 1%) are 30 ms; one request streamed no gap.
        result["itls"] = [[first] + [0.01] * 62 + [0.03 if i < 10 else 0.01]
                          for i in range(40)] + [[]]
        path.write_text(json.dumps(result))
    summary = threshold.summarize(tmp_path, ["16"], 0.1)
    via, whole = summary["rows"][0]["via"], summary["rows"][0]["whole"]
    assert via["p50_first_gap_ms"] == 400.0 and whole["p50_first_gap_ms"] == 8.0
    assert via["p99_later_itl_ms"] == pytest.approx(10.0)
    assert whole["p99_later_itl_ms"] == pytest.approx(10.0)
    assert "| 16 | 400.0 | 8.0 |" in threshold.markdown(summary)


def test_a_result_without_per_request_gaps_shows_none(tmp_path: Path) -> None:
    write(tmp_path, "via", 16, 10, 10)
    write(tmp_path, "whole", 16, 20, 10)
    summary = threshold.summarize(tmp_path, ["16"], 0.1)
    assert summary["rows"][0]["via"]["p99_later_itl_ms"] is None
    assert "| 16 | - | - | - | - |" in threshold.markdown(summary)
