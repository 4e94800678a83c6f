"""loadtest/admission.py's report of a burst: counts by status, refusal latency, waits."""

from __future__ import annotations

from loadtest_scripts import load_script

admission = load_script("admission")


def test_report_counts_each_fate_and_times_refusals_and_waits() -> None:
    Outcome = admission.Outcome
    outcomes = [Outcome(200, 3.0, 1.0, complete=True), Outcome(200, 5.0, 2.0, complete=True),
                Outcome(200, 4.0, 1.5, error="stream ended without [DONE]"),
                Outcome(429, 0.05, retry_after="3"), Outcome(429, 1.2, retry_after="3"),
                Outcome(429, 0.1), Outcome(0, 9.0, error="ServerDisconnectedError: gone")]
    result = admission.report(outcomes, max_tokens=32)
    assert result["statuses"] == {"200": 3, "429": 3, "0": 1}
    assert (result["completed"], result["refused"], result["refusals_over_1s"]) == (2, 3, 1)
    assert result["retry_after"] == {"3": 2, "missing": 1}
    assert result["refusal_latency"] == {"count": 3, "p50_s": 0.1, "p99_s": 1.2, "max_s": 1.2}
    assert result["admitted_wait"]["count"] == 3 and result["admitted_wait"]["max_s"] == 2.0
    assert [f["status"] for f in result["failures"]] == [200, 0]
