"""loadtest/disagg_sweep.py: goodput under TTFT/ITL SLOs from per-rate bench results, the
ratios of 1 prefill + 1 decode over 2 mixed workers, and saying so where they are undefined.

The result files are what `meshserve bench serve --output-json` writes (its own run_result
and document functions) for requests with chosen TTFTs and inter-token gaps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest_scripts import LOADTEST, load_script

from meshserve.bench.serve.client import RequestResult
from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.metrics import run_result
from meshserve.bench.serve.report import document, write_json

disagg_sweep = load_script("disagg_sweep")
SCRIPT = LOADTEST / "disagg_sweep.py"
SLO = disagg_sweep.Slo(ttft_p90_ms=2000.0, itl_p99_ms=50.0)


def request(ttft_s: float, gap_s: float, tokens: int = 11, ok: bool = True) -> RequestResult:
    """A streamed request: first token after ttft_s, then tokens - 1 gaps of gap_s."""
    if not ok:
        return RequestResult(success=False, status=503, error="overloaded", prompt_len=100)
    return RequestResult(success=True, status=200, prompt_len=100, output_tokens=tokens,
                         ttft=ttft_s, itl=[gap_s] * (tokens - 1),
                         latency=ttft_s + gap_s * (tokens - 1))


def write_rate(root: Path, config: str, rate: str, outputs: list[RequestResult]) -> None:
    """root/config/rate_R.json as the bench writes it."""
    bench = ServeConfig(dataset="long-prompt", vocab_size=1000, request_rate=float(rate),
                        num_prompts=len(outputs), goodput=("ttft:2000", "tpot:50"))
    result = run_result(outputs, duration_s=10.0, slos_ms=bench.goodput_slos_ms)
    write_json(root / config / f"rate_{rate}.json", document(bench, [result]))


def fast(n: int = 10) -> list[RequestResult]:
    return [request(0.5, 0.02) for _ in range(n)]


def slow_itl(n: int = 10) -> list[RequestResult]:
    return [request(0.5, 0.08) for _ in range(n)]


def slow_ttft(n: int = 10) -> list[RequestResult]:
    return [request(3.0, 0.02) for _ in range(n)]


def test_goodput_is_the_highest_rate_meeting_both_slos(tmp_path: Path) -> None:
    # Rate 2 misses ITL, rate 3 meets both again (goodput is the highest met rate), rate 4
    # misses TTFT, rate 6 has one failed request, rate 8 left no result.
    for rate, outputs in (("1", fast()), ("2", slow_itl()), ("3", fast()),
                          ("4", slow_ttft()), ("6", fast(9) + [request(0, 0, ok=False)])):
        write_rate(tmp_path, "mixed", rate, outputs)
    runs = disagg_sweep.load_runs(tmp_path / "mixed", ["1", "2", "3", "4", "6", "8"])
    assert [run.meets(SLO) for run in runs] == [True, False, True, False, False, False]
    assert runs[-1].figures is None
    assert runs[0].figures["p99_itl_ms"] == 20.0
    assert runs[0].figures["request_goodput"] == 1.0  # 10 good requests over 10 s
    assert disagg_sweep.goodput(runs, SLO) == "3"
    assert disagg_sweep.goodput(runs[1:2], SLO) is None


def test_an_slo_is_met_at_its_bound_and_missed_past_it(tmp_path: Path) -> None:
    write_rate(tmp_path, "at", "1", [request(2.0, 0.05) for _ in range(10)])
    write_rate(tmp_path, "past", "1", [request(2.0, 0.0501) for _ in range(10)])
    at, past = (disagg_sweep.load_runs(tmp_path / name, ["1"])[0] for name in ("at", "past"))
    assert at.meets(SLO)
    assert not past.meets(SLO)


def test_ratios_of_the_second_config_over_the_first(tmp_path: Path) -> None:
    for rate, mixed, disagg in (("1", fast(), fast()), ("2", slow_itl(), fast()),
                                ("3", slow_itl(), fast())):
        write_rate(tmp_path, "mixed", rate, mixed)
        write_rate(tmp_path, "disagg", rate, disagg)
    # The decode worker's gaps at rate 1: 10 ms, half the mixed pair's.
    write_rate(tmp_path, "disagg", "1", [request(0.5, 0.01) for _ in range(10)])
    summary = disagg_sweep.summarize(tmp_path, ["mixed", "disagg"], ["1", "2", "3"], SLO, 10)
    assert summary["configs"]["mixed"]["goodput"] == "1"
    assert summary["configs"]["disagg"]["goodput"] == "3"
    assert summary["goodput_ratio"] == 3.0
    assert summary["itl_p99_ratio"] == 0.5
    assert "at 1 req/s" in summary["itl_p99_ratio_note"]
    assert summary["per_rate_ratios"]["2"]["p99_itl_ms"] == 0.25
    text = disagg_sweep.markdown(summary)
    assert "- goodput ratio: 3.00 (3 over 1 req/s; target >= 1.5)" in text
    assert "Goodput: 3 req/s." in text


def test_no_rate_met_leaves_the_ratios_undefined(tmp_path: Path) -> None:
    for rate in ("1", "2"):
        write_rate(tmp_path, "mixed", rate, slow_itl())
        write_rate(tmp_path, "disagg", rate, fast())
    summary = disagg_sweep.summarize(tmp_path, ["mixed", "disagg"], ["1", "2"], SLO, 10)
    assert summary["configs"]["mixed"]["goodput"] is None
    assert summary["goodput_ratio"] is None and summary["itl_p99_ratio"] is None
    assert summary["goodput_ratio_note"].startswith("undefined: the first config met the SLOs "
                                                    "at no rate")
    text = disagg_sweep.markdown(summary)
    assert "Goodput: none (no rate met the SLOs)." in text
    assert "- goodput ratio: n/a (undefined" in text
    assert "ITL p99 ratio at the first config's goodput rate: n/a (undefined" in text
    assert disagg_sweep.goodput_ratio(None, None)[1] == ("undefined: no rate met the SLOs in "
                                                          "either config")


def test_the_script_writes_the_report_with_the_handoff_counters(tmp_path: Path) -> None:
    write_rate(tmp_path, "mixed", "1", fast())
    write_rate(tmp_path, "disagg", "1", fast())
    received = "meshserve:kv_handoff_blocks_total{direction=received}"
    metrics = {"services": {"decode-0": {received: 122.0, "vllm:num_requests_running{}": 0.0},
                            "gateway": {"meshserve:gateway_http_listening{}": 1.0}}}
    (tmp_path / "disagg" / "metrics.json").write_text(json.dumps(metrics))
    out, js = tmp_path / "summary.md", tmp_path / "summary.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--rates", "1", "2",
                          "--num-prompts", "10", "--out", str(out), "--json", str(js)],
                         capture_output=True, text=True, check=True)
    assert run.stdout == out.read_text()
    assert f"- decode-0: `{received}` 122" in run.stdout
    # Rate 2 left no file: a row of 11 cells saying so, the SLOs not met.
    missing = "| 2 | no result (failed, timed out or skipped: see CONFIG/steps.log) |"
    assert missing + "  |" * 8 + " no |" in run.stdout
    saved = json.loads(js.read_text())
    assert saved["configs"]["disagg"]["kv_handoff"] == {"decode-0": {received: 122.0}}
    assert saved["configs"]["mixed"]["kv_handoff"] == {}
    assert saved["goodput_ratio"] == 1.0
