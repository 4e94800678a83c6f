"""loadtest/kv_routing.py on a tiny model: two stacks of two workers, one report.

The driver starts `meshserve up` once per routing policy and runs the serving benchmark's
prefix-heavy requests through each; the report must hold both runs with every request
served, prompt-cache hits the gateway reported, the ratios of the two runs' own figures, and
where it ran.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

_SCRIPT = Path(__file__).resolve().parents[2] / "loadtest" / "kv_routing.py"
PROMPTS = 12
WARM = 4  # untimed requests before the timed ones


def _load_driver():
    spec = importlib.util.spec_from_file_location("kv_routing", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_routing"] = module
    spec.loader.exec_module(module)
    return module


kv_routing = _load_driver()


def test_both_policies_run_the_same_requests_into_one_report(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", "llama", seed=3, max_position_embeddings=1024)
    out = tmp_path / "report.json"
    argv = ["--model", str(model), "--num-prompts", str(PROMPTS), "--concurrency", "3",
            "--prefix-tenants", "2", "--prefix-len", "64", "--prefix-question-len", "8",
            "--output-len", "4", "--num-warmup", "1", "--run-dir", str(tmp_path / "run"),
            "--startup-timeout-s", "300", "--metrics-dir", str(tmp_path / "metrics"),
            "--policies", "kv-aware@2,round-robin", "--warm-requests", str(WARM),
            "--warm-concurrency", "2", "--out", str(out),
            "--", "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256",
            "--stop-grace-s", "5"]
    assert kv_routing.main(argv) == 0
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["kv-aware@2", "round-robin"]
    assert report["command"].endswith(" ".join(argv))
    assert report["versions"]["torch"] and report["versions"]["gpu"] is None
    assert report["launcher_flags"] == argv[argv.index("--") + 1:]
    for spec, run in report["runs"].items():
        assert (run["routing"], run["launcher"]["routing"]) == (spec, spec.split("@")[0])
        assert (run["completed"], run["failed"]) == (PROMPTS, 0)
        assert run["total_input_tokens"] == PROMPTS * 72
        assert run["total_output_tokens"] == PROMPTS * 4
        assert 0 < run["median_ttft_ms"] <= run["p90_ttft_ms"] <= run["p99_ttft_ms"]
        # Two tenants over 12 requests: most find their tenant's 64 tokens (4 blocks) cached.
        assert run["total_cached_tokens"] > 0
        assert run["cached_token_fraction"] == pytest.approx(
            run["total_cached_tokens"] / run["total_input_tokens"])
        # Every request (the warm pass, the one warm-up, the timed ones) finished on one
        # of the two workers; the figures count the timed ones only.
        workers = run["per_worker"]
        assert set(workers) == {"worker-0", "worker-1"}
        assert sum(w["sequences_finished"] for w in workers.values()) == WARM + 1 + PROMPTS
    kv, rr = report["runs"]["kv-aware@2"], report["runs"]["round-robin"]
    assert report["ratios"] == pytest.approx({
        "output_throughput_kv_aware@2_over_round_robin":
            kv["output_throughput"] / rr["output_throughput"],
        "p90_ttft_round_robin_over_kv_aware@2": rr["p90_ttft_ms"] / kv["p90_ttft_ms"]})
    assert report["workload"]["warm_requests"] == WARM
    # Round-robin spreads the 17 requests evenly.
    assert sorted(w["sequences_finished"] for w in rr["per_worker"].values()) == [8, 9]
    # --metrics-dir: every service's /metrics after each run, per-request TTFTs, gauges.
    for policy in ("kv-aware@2", "round-robin"):
        dumped = tmp_path / "metrics" / policy
        assert "meshserve:worker_sequences_finished_total" in \
            (dumped / "worker-0.prom").read_text()
        assert (dumped / "gateway.prom").is_file() and (dumped / "scheduler.prom").is_file()
        assert len(json.loads((dumped / "requests.json").read_text())["ttfts"]) == PROMPTS
        assert isinstance(json.loads((dumped / "gauges.json").read_text()), list)
        assert report["runs"][policy]["per_worker"]["worker-0"]["kvstore_probes"] >= 0
