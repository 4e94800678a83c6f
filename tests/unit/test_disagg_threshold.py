"""The short-prompt threshold's summariser (loadtest/disagg_threshold.py) on result files
written here: a length goes through the prefill pool when its TTFT p50 is lower there or
running it whole costs more than the ITL margin; the threshold is the shortest length from
which every longer one does; a missing or failed run decides nothing."""

from __future__ import annotations

import json
from pathlib import Path

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
