"""`meshserve bench serve` against a fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_openai_server import ERROR_MESSAGES, MODEL, FakeOpenAIServer

from meshserve.bench.serve import datasets
from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.runner import run_benchmark
from meshserve.bench.serve.workload import build_workload
from meshserve.cli.main import main as cli_main

VOCAB_500 = datasets.Vocabulary(500, frozenset())
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VLLM_FIELDS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
    "max_concurrency", "request_rate", "burstiness", "input_lens", "output_lens", "ttfts",
    "itls", "errors", *(f"{stat}_{metric}_ms" for stat in ("mean", "median", "p90", "p99")
                        for metric in ("ttft", "tpot", "itl", "e2el"))}


def fails_by_ordinal(n: int) -> Any:
    """Of every 6 requests: #1 gets 429, #3 gets 500, #5 an error event mid-stream."""
    return {1: 429, 3: 500, 5: "stream_error"}.get(n % 6, "ok")


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def config_for(server: FakeOpenAIServer, **values: Any) -> ServeConfig:
    base: dict[str, Any] = {"base_url": server.url, "vocab_size": 500, "num_prompts": 12,
                            "random_input_len": 20, "random_output_len": 6, "num_warmup": 0,
                            "progress": False}
    return ServeConfig(**{**base, **values})


async def test_token_prompts_stream_and_every_figure_adds_up(server: FakeOpenAIServer) -> None:
    config = config_for(server, max_concurrency=3, num_warmup=2, ignore_eos=True,
                        goodput=("e2el:60000",))
    workload = build_workload(config)
    (r,) = await run_benchmark(config, workload)
    assert (r["completed"], r["failed"], r["model"]) == (12, 0, MODEL)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (12 * 20, 12 * 6)
    assert r["request_goodput"] == pytest.approx(12 / r["duration"])
    assert r["output_throughput"] == pytest.approx(72 / r["duration"])
    # One clock read per network read: two chunks that arrive in one read are 0 s apart.
    assert all(len(itl) == 5 and all(g >= 0 for g in itl) for itl in r["itls"])
    assert all(0 < t < e for t, e in zip(r["ttfts"], r["e2els"], strict=True))
    assert all(t + sum(itl) <= e for t, itl, e in zip(r["ttfts"], r["itls"], r["e2els"],
                                                      strict=True))
    assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_tpot_ms"] > 0
    assert server.max_in_flight <= 3
    warm, timed = server.bodies[:2], server.bodies[2:]
    assert all(b["max_tokens"] == 6 for b in warm)  # warm-up: short outputs, other prompts
    assert not {tuple(b["prompt"]) for b in warm} & {tuple(r.prompt) for r in workload.requests}
    assert sorted(b["prompt"] for b in timed) == sorted(r.prompt for r in workload.requests)
    for body in timed:
        assert body["model"] == MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 6
        assert "min_tokens" not in body and body["temperature"] == 0.0


async def test_failures_are_counted_by_status_and_message() -> None:
    with FakeOpenAIServer(plan=fails_by_ordinal) as server:
        config = config_for(server, max_concurrency=4)
        (r,) = await run_benchmark(config, build_workload(config))
    assert (r["completed"], r["failed"]) == (6, 6)
    assert r["total_output_tokens"] == 6 * 6 and r["total_input_tokens"] == 6 * 20
    assert r["failures"]["by_status"] == {"429": 2, "500": 2, "200": 2}
    assert r["failures"]["by_error"] == {message: 2 for message in ERROR_MESSAGES.values()}
    failed = [i for i, e in enumerate(r["errors"]) if e]
    assert all(r["output_lens"][i] == 0 and r["itls"][i] == [] for i in failed)
    assert server.max_in_flight <= 4


async def test_without_usage_output_tokens_are_the_content_chunks() -> None:
    with FakeOpenAIServer(usage=False) as server:
        config = config_for(server, num_prompts=4, random_output_len=9)
        (r,) = await run_benchmark(config, build_workload(config))
    assert r["output_lens"] == [9] * 4 and r["completed"] == 4


async def test_chat_with_sharegpt_text_and_a_tokenizer(tmp_path: Path) -> None:
    from tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    conversations = [{"conversations": [
        {"from": "human", "value": f"hello world number {i} the quick brown fox"},
        {"from": "gpt", "value": "the lazy dog " * (i + 2)}]} for i in range(5)]
    (tmp_path / "sg.json").write_text(json.dumps(conversations))
    with FakeOpenAIServer(api_key="k1") as server:
        config = config_for(server, endpoint="chat", dataset="sharegpt",
                            dataset_path=tmp_path / "sg.json", tokenizer=tmp_path / "tok",
                            vocab_size=None, num_prompts=5, api_key="k1", model="named")
        (r,) = await run_benchmark(config, build_workload(config))
    assert (r["completed"], r["failed"]) == (5, 0)
    replies = {c["conversations"][0]["value"]: len(tokenizer.encode(c["conversations"][1]["value"]))
               for c in conversations}
    for body in server.bodies:
        (message,) = body["messages"]
        assert message["role"] == "user" and body["model"] == "named"
        assert body["max_completion_tokens"] == replies[message["content"]]
    assert set(server.authorizations) == {"Bearer k1"}
    assert r["total_output_tokens"] == sum(replies.values())
    # The role-only first chunk carries no content: one gap fewer than tokens.
    assert sorted(len(i) + 1 for i in r["itls"]) == sorted(r["output_lens"])


def test_cli_sweep_writes_json_with_vllm_fields_and_a_png(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with FakeOpenAIServer(plan=fails_by_ordinal) as server:
        code = cli_main(["bench", "serve", "--base-url", server.url, "--vocab-size", "500",
                         "--num-prompts", "12", "--random-input-len", "16",
                         "--random-output-len", "5", "--concurrency-sweep", "1,4",
                         "--num-warmup", "0", "--goodput", "ttft:10000", "e2el:60000",
                         "--request-rate", "2000", "--burstiness", "0.5", "--no-progress",
                         "--output-json", str(out), "--plot", str(png)])
    assert code == 0
    assert server.max_in_flight <= 4
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serve" and doc["concurrencies"] == [1, 4]
    assert doc["environment"]["base_url"] == server.url and doc["environment"]["python"]
    assert doc["config"]["goodput"] == ["ttft:10000", "e2el:60000"]
    for result, cap in zip(doc["results"], [1, 4], strict=True):
        assert VLLM_FIELDS <= set(result)
        assert (result["max_concurrency"], result["request_rate"]) == (cap, 2000.0)
        assert (result["completed"], result["failed"]) == (6, 6)
        assert result["failures"]["by_status"] == {"429": 2, "500": 2, "200": 2}
    assert png.read_bytes()[:8] == PNG_MAGIC
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].split()[0] == "conc" and [row.split()[0] for row in rows[1:]] == ["1", "4"]


def test_cli_single_run_prints_vllms_block_and_plots_cdfs(server: FakeOpenAIServer,
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    out, png = tmp_path / "one.json", tmp_path / "one.png"
    assert cli_main(["bench", "serve", "--base-url", server.url, "--vocab-size", "500",
                     "--num-prompts", "6", "--random-input-len", "8", "--random-output-len",
                     "4", "--max-concurrency", "2", "--no-progress", "--output-json", str(out),
                     "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert VLLM_FIELDS <= set(doc) and doc["completed"] == 6 and doc["max_concurrency"] == 2
    assert doc["request_goodput"] is None and doc["request_rate"] == "inf"
    assert png.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms):" in printed
    # This server reports no cached tokens: no row claims a figure it did not give.
    assert doc["total_cached_tokens"] is None and "from cache" not in printed


def test_cli_prefix_heavy_reports_the_servers_prefix_cache_hits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "heavy.json"
    with FakeOpenAIServer(cache_block=16) as server:
        assert cli_main(["bench", "serve", "--base-url", server.url, "--vocab-size", "500",
                         "--dataset", "prefix-heavy", "--prefix-tenants", "3",
                         "--prefix-len", "32", "--prefix-question-len", "8",
                         "--num-prompts", "20", "--max-concurrency", "1", "--no-progress",
                         "--output-json", str(out)]) == 0
    timed = server.bodies[1:]  # after one warm-up request
    assert all(len(b["prompt"]) == 40 and b["max_tokens"] == 64 for b in timed)
    tenants = {tuple(b["prompt"][:32]) for b in timed}
    assert tenants <= {tuple(p) for p in datasets.tenant_prefixes(3, 32, VOCAB_500, 0)}
    doc = json.loads(out.read_text())
    # Every request but a tenant's first finds its 32-token prefix (two blocks) cached.
    assert doc["total_cached_tokens"] == (20 - len(tenants)) * 32
    assert doc["cached_token_fraction"] == pytest.approx((20 - len(tenants)) * 32 / (20 * 40))
    assert doc["cached_tokens"].count(0) == len(tenants)
    printed = capsys.readouterr().out
    assert f"{doc['total_cached_tokens']:>10}" in printed.split("Prompt tokens from cache:")[1]


def test_cli_long_prompt_sends_long_prompts_and_reports_goodput(
        server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "long.json"
    assert cli_main(["bench", "serve", "--base-url", server.url, "--vocab-size", "500",
                     "--dataset", "long-prompt", "--max-model-len", "4096", "--seed", "5",
                     "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos",
                     "--goodput", "ttft:60000", "tpot:60000", "e2el:60000", "--no-progress",
                     "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99.9",
                     "--output-json", str(out)]) == 0
    expected = datasets.long_prompt_lengths(8, (2048, 8192), (64, 256), 4096, seed=5)
    timed = server.bodies[1:]  # after one warm-up request
    assert sorted((len(b["prompt"]), b["max_tokens"]) for b in timed) == sorted(expected)
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (8, 0)
    assert doc["total_input_tokens"] == sum(i for i, _ in expected)
    assert doc["total_output_tokens"] == sum(o for _, o in expected)
    assert doc["config"]["goodput"] == ["ttft:60000", "tpot:60000", "e2el:60000"]
    # Every request met the SLOs: goodput is the request throughput, printed as vLLM does.
    assert doc["request_goodput"] == pytest.approx(8 / doc["duration"])
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    printed = capsys.readouterr().out
    row = printed.split("Request goodput (req/s):")[1].splitlines()[0]
    assert float(row) == pytest.approx(doc["request_goodput"], abs=0.005)
    # The asked percentiles, under vLLM's names, of the pooled gaps the JSON holds.
    gaps_ms = [gap * 1000 for itl in doc["itls"] for gap in itl]
    assert doc["p99.9_itl_ms"] == pytest.approx(float(np.percentile(gaps_ms, 99.9)))
    assert doc["p50_ttft_ms"] == pytest.approx(doc["median_ttft_ms"])
    assert "p50_tpot_ms" not in doc and doc["config"]["metric_percentiles"] == [50.0, 99.9]
    assert "P99.9 ITL (ms):" in printed and "P50 TPOT (ms):" not in printed


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_a_server_that_is_down_fails_fast_and_clearly(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    started = time.monotonic()
    assert cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{_closed_port()}",
                     "--vocab-size", "50", "--num-prompts", "3", "--no-progress"]) == 1
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert err.startswith("meshserve bench serve: cannot reach http://127.0.0.1:")


def test_a_wrong_api_key_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAIServer(api_key="right") as server:
        assert cli_main(["bench", "serve", "--base-url", server.url, "--api-key", "wrong",
                         "--vocab-size", "50", "--num-prompts", "2", "--no-progress"]) == 1
        assert server.bodies == []
    assert "--api-key" in capsys.readouterr().err


def test_every_warm_up_failing_stops_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAIServer(plan=lambda n: 500) as server:
        assert cli_main(["bench", "serve", "--base-url", server.url, "--vocab-size", "50",
                         "--num-prompts", "4", "--num-warmup", "2", "--no-progress"]) == 1
        assert len(server.bodies) == 2
    assert "every warm-up request failed" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    (["--dataset", "sharegpt", "--dataset-path", "/nonexistent/sg.json",
      "--sharegpt-output-len", "5"], "cannot read"),
    (["--tokenizer", "/nonexistent/tok", "--prompt-format", "text"], "cannot load a tokenizer"),
    (["--vocab-size", "50", "--num-prompts", "0"], "num_prompts"),
    (["--vocab-size", "50", "--bogus"], "unrecognized arguments"),
])
def test_bad_input_exits_2_before_sending_anything(server: FakeOpenAIServer, args: list[str],
                                                   words: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "serve", "--base-url", server.url, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshserve bench serve: ") and words in err
    assert "meshserve bench serve: meshserve bench serve" not in err
    assert server.bodies == []


def test_plot_without_matplotlib_fails_at_start_up(server: FakeOpenAIServer, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec: not installed
    assert cli_main(["bench", "serve", "--base-url", server.url, "--vocab-size", "50",
                     "--plot", str(tmp_path / "p.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert server.bodies == [] and not (tmp_path / "p.png").exists()
