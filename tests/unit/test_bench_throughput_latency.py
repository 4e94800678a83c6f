"""`meshserve bench throughput` feeds the engine bench serve's token prompts and reports its
TTFT/ITL/TPOT/E2E under bench serve's field names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshserve.bench import engine as bench
from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.workload import build_workload
from meshserve.cli.main import main as cli_main
from meshserve.services.worker.engine.engine import LLMEngine

LATENCY_FIELDS = {f"{stat}_{metric}_ms" for stat in ("mean", "median", "p90", "p99")
                  for metric in ("ttft", "tpot", "itl", "e2el")}


def test_throughput_runs_bench_serves_prompts_and_reports_its_latency_fields(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fed: list[tuple[str, list[int]]] = []
    add_request = LLMEngine.add_request

    def recording(self: LLMEngine, request_id: str, prompt: list[int], *args: Any,
                  **kwargs: Any) -> Any:
        fed.append((request_id, list(prompt)))
        return add_request(self, request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    out = tmp_path / "tput.json"
    assert cli_main(["bench", "throughput", "--model", str(tiny_llama_dir), "--load-format",
                     "dummy", "--device", "cpu", "--num-kv-blocks", "64", "--no-progress",
                     "--dataset", "sharegpt-like", "--num-prompts", "5", "--seed", "7",
                     "--max-model-len", "200", "--num-iters-warmup", "0",
                     "--output-json", str(out)]) == 0
    serve = build_workload(ServeConfig(dataset="sharegpt-like", model_config=tiny_llama_dir,
                                       max_model_len=200, num_prompts=5, seed=7,
                                       num_warmup=0))
    assert [p for rid, p in fed if rid.startswith("tput-")] == [r.prompt for r in
                                                                serve.requests]
    r = json.loads(out.read_text())
    assert LATENCY_FIELDS <= set(r)
    assert r["output_tokens"] == sum(req.output_len for req in serve.requests)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{metric}_ms"] <= r[f"p99_{metric}_ms"]
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"] <= r["elapsed_s"] * 1000


def test_token_times_split_a_several_token_delivery_per_token() -> None:
    times = bench.TokenTimes()
    times.add("a", 1, False, 0.5)    # first token at 0.5 s
    times.add("b", 2, False, 0.5)    # b's first delivery brings two tokens
    times.add("a", 2, False, 1.1)    # 0.6 s later, two tokens: two gaps of 0.3 s
    times.add("b", 1, True, 0.9)
    times.add("a", 1, True, 1.2)
    assert times.ttft == {"a": 0.5, "b": 0.5} and times.e2e == {"a": 1.2, "b": 0.9}
    assert times.itl == {"a": [pytest.approx(0.3)] * 2 + [pytest.approx(0.1)],
                         "b": [pytest.approx(0.4)]}
    assert times.tokens == {"a": 4, "b": 3}
    f = times.latency_fields()
    assert f["mean_ttft_ms"] == pytest.approx(500)
    assert f["mean_e2el_ms"] == pytest.approx(1050)
    assert f["mean_tpot_ms"] == pytest.approx((700 / 3 + 400 / 2) / 2)
    assert f["median_itl_ms"] == pytest.approx(300)
