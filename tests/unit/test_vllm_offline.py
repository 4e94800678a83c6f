"""loadtest/vllm_offline.py, the vLLM peer, on CPU: its flags and prompt files without vLLM,
its runs against a stand-in `vllm` package (what it asks of vLLM, and the figures it derives
from a clock the stand-in advances), the report, and the whole chain from `meshserve bench
--save-prompts` to the side-by-side table."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from loadtest_scripts import LOADTEST, load_script
from vllm_stand_in import FAKE_VLLM

from meshserve.cli.main import main as cli_main
from meshserve.services.worker.engine.engine import LLMEngine

SCRIPT = LOADTEST / "vllm_offline.py"

@pytest.fixture()
def peer() -> ModuleType:
    return load_script("vllm_offline")


@pytest.fixture()
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer: ModuleType
              ) -> Iterator[ModuleType]:
    """The stand-in imported as `vllm`, its clock driving the script's time; gone from
    sys.modules afterwards, so that no later test finds a `vllm`."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    assert "vllm" not in sys.modules
    import vllm

    monkeypatch.setattr(peer, "time", SimpleNamespace(perf_counter=lambda: vllm.CLOCK[0]))
    yield vllm
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def write_prompts(path: Path, requests: list[tuple[list[int], int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt_token_ids": p, "output_tokens": n}) + "\n"
                            for p, n in requests))
    return path


def test_help_and_report_import_no_vllm(tmp_path: Path) -> None:
    poisoned = tmp_path / "poison" / "vllm"
    poisoned.mkdir(parents=True)
    (poisoned / "__init__.py").write_text("raise RuntimeError('vllm imported')\n")
    (tmp_path / "vllm.json").write_text(json.dumps({"startup_s": 1.0}))
    env = {"PYTHONPATH": str(tmp_path / "poison"), "PATH": "/usr/bin:/bin"}
    for args in (["--help"], ["run", "--help"], ["check", "--help"],
                 ["report", "--vllm", str(tmp_path / "vllm.json")]):
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                              text=True, env=env, check=False)
        assert done.returncode == 0, (args, done.stderr)
    assert "--llm-kwargs" in subprocess.run([sys.executable, str(SCRIPT), "run", "--help"],
                                            capture_output=True, text=True, env=env,
                                            check=True).stdout


def test_run_needs_a_prompt_file(peer: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        peer.parse_args(["run", "--model", "m"])
    assert "--throughput-prompts, --latency-prompts or both" in capsys.readouterr().err


def test_llm_kwargs_fixed_then_overridden(peer: ModuleType) -> None:
    args = peer.parse_args(["run", "--model", "/m", "--latency-prompts", "l.jsonl",
                            "--max-model-len", "4096", "--llm-kwargs",
                            '{"tensor_parallel_size": 2, "seed": 5}'])
    assert peer.llm_kwargs(args) == {
        "model": "/m", "load_format": "dummy", "skip_tokenizer_init": True,
        "max_model_len": 4096, "gpu_memory_utilization": 0.9, "seed": 5,
        "attention_config": {"backend": "FLASH_ATTN"}, "tensor_parallel_size": 2}
    auto = peer.parse_args(["run", "--model", "/m", "--latency-prompts", "l.jsonl",
                            "--attention-backend", "auto"])
    assert "attention_config" not in peer.llm_kwargs(auto)
    with pytest.raises(TypeError, match="JSON object"):
        peer.llm_kwargs(peer.parse_args(["run", "--model", "/m", "--latency-prompts", "l",
                                         "--llm-kwargs", "[1]"]))


def test_read_prompts_keeps_order_and_names_a_bad_line(peer: ModuleType, tmp_path: Path
                                                       ) -> None:
    good = write_prompts(tmp_path / "p.jsonl", [([5, 6, 7], 3), ([9], 1)])
    assert peer.read_prompts(good) == [peer.Request([5, 6, 7], 3), peer.Request([9], 1)]
    for line in ('{"prompt_token_ids": [], "output_tokens": 2}',
                 '{"prompt_token_ids": [1], "output_tokens": 0}',
                 '{"prompt_token_ids": ["a"], "output_tokens": 2}', "[1, 2]"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt_token_ids": [1], "output_tokens": 2}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"{bad}:2"):
            peer.read_prompts(bad)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        peer.read_prompts(tmp_path / "empty.jsonl")


def test_run_asks_vllm_for_the_files_prompts_and_times_them(
        peer: ModuleType, fake_vllm: Any, tmp_path: Path) -> None:
    tput = write_prompts(tmp_path / "t.jsonl", [([1, 2, 3], 4), ([4, 5], 20), ([6], 2)])
    lat = write_prompts(tmp_path / "l.jsonl", [([10 + i, 20 + i], 9) for i in range(4)])
    out = tmp_path / "vllm.json"
    assert peer.main(["run", "--model", "/models/x", "--throughput-prompts", str(tput),
                      "--latency-prompts", str(lat), "--latency-warmup", "1",
                      "--num-iters-warmup", "2", "--warmup-prompts", "4",
                      "--max-model-len", "512", "--llm-kwargs", '{"enforce_eager": true}',
                      "--output-json", str(out)]) == 0
    calls = fake_vllm.CALLS
    assert calls[0] == ("init", {"model": "/models/x", "load_format": "dummy",
                                 "skip_tokenizer_init": True, "max_model_len": 512,
                                 "gpu_memory_utilization": 0.9, "seed": 0,
                                 "attention_config": {"backend": "FLASH_ATTN"},
                                 "enforce_eager": True})
    generates = [c for c in calls if c[0] == "generate"]
    # Two warm-up batches: the timed prompts reversed (cycled to 4), min(16, 4) tokens each.
    for _, prompts, params, tqdm in generates[:2]:
        assert prompts == [[3, 2, 1], [5, 4], [6], [3, 2, 1]] and not tqdm
        assert [p["max_tokens"] for p in params] == [4] * 4
    _, prompts, params, _ = generates[2]
    assert prompts == [[1, 2, 3], [4, 5], [6]]
    assert params == [{"temperature": 0.0, "ignore_eos": True, "max_tokens": n,
                       "detokenize": False} for n in (4, 20, 2)]
    # Latency: each prompt to 9 tokens, then reversed to 1.
    assert [(c[1], [p["max_tokens"] for p in c[2]]) for c in generates[3:5]] == [
        ([[10, 20]], [9]), ([[20, 10]], [1])]
    assert len(generates) == 3 + 2 * 4
    r = json.loads(out.read_text())
    assert r["startup_s"] == pytest.approx(3.0)
    t = r["throughput"]
    elapsed = 0.05 + 0.01 * 20  # the stand-in's cost of the one timed call
    assert t["elapsed_s"] == pytest.approx(elapsed)
    assert (t["num_requests"], t["input_tokens"], t["output_tokens"]) == (3, 6, 26)
    assert t["output_tokens_per_s"] == pytest.approx(26 / elapsed)
    assert t["requests_per_s"] == pytest.approx(3 / elapsed)
    assert t["short_outputs"] == 0 and t["prompts_sha256"] == peer.file_sha256(tput)
    lat_r = r["latency"]
    assert lat_r["num_iters"] == 3 and lat_r["input_len"] == 2 and lat_r["output_len"] == 9
    assert lat_r["latency_s"]["avg"] == pytest.approx(0.05 + 0.09)
    assert lat_r["ttft_s"]["p50"] == pytest.approx(0.06)
    assert lat_r["tpot_s"]["avg"] == pytest.approx(0.01)
    assert r["engine"]["num_gpu_blocks"] == 1234 and r["engine"]["dtype"] == "torch.bfloat16"
    assert r["environment"]["vllm"] == "0.0-stand-in"


def test_check_imports_each_module_and_fails_on_a_missing_one(
        peer: ModuleType, fake_vllm: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert peer.main(["check", "--modules", "vllm,json"]) == 0
    assert peer.main(["check", "--modules", "vllm,vllm.no_such_module"]) == 1
    assert "import vllm.no_such_module: ModuleNotFoundError" in capsys.readouterr().out


def test_report_puts_both_side_by_side(peer: ModuleType, tmp_path: Path) -> None:
    figures = {"num_requests": 10, "input_tokens": 100, "output_tokens": 200}
    (tmp_path / "vllm.json").write_text(json.dumps({
        "startup_s": 51.2, "llm_kwargs": {"model": "/m/llama"},
        "environment": {"gpu_name": "H100", "vllm": "0.22.0", "torch": "2.11.0"},
        "throughput": {**figures, "output_tokens_per_s": 8000.0, "requests_per_s": 40.0,
                       "total_tokens_per_s": 12000.0, "elapsed_s": 2.5,
                       "prompts_sha256": "ab" * 32},
        "latency": {"tpot_s": {"avg": 0.0070, "p50": 0.0069}, "ttft_s": {"avg": 0.02},
                    "latency_s": {"avg": 0.9}}}))
    (tmp_path / "tput.json").write_text(json.dumps({
        **figures, "output_tokens_per_s": 10400.0, "requests_per_s": 52.0,
        "total_tokens_per_s": 15600.0, "elapsed_s": 1.92}))
    summary, table = peer.side_by_side(tmp_path / "vllm.json", tmp_path / "tput.json",
                                       tmp_path / "missing.json")
    ratios = {row["figure"]: row["ratio"] for row in summary["rows"]}
    assert ratios["output tokens/s"] == pytest.approx(1.3)
    assert ratios["TPOT (avg)"] is None  # no meshserve latency result
    assert summary["same_workload"] == {"num_requests": True, "input_tokens": True,
                                        "output_tokens": True}
    assert summary["vllm_startup_s"] == 51.2 and summary["gpu"] == "H100"
    assert "| output tokens/s | 8,000.00 | 10,400.00 | 1.300 | >= 1.3 |" in table
    assert "| TPOT (avg) | 7.00 ms | - | - | <= 0.9 |" in table
    assert "vLLM started in 51.2 s" in table and "tokens: yes" in table


def test_meshserve_saved_prompts_are_what_vllm_runs(
        peer: ModuleType, fake_vllm: Any, tiny_llama_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fed: list[tuple[str, list[int]]] = []
    add_request = LLMEngine.add_request

    def recording(self: LLMEngine, request_id: str, prompt: list[int], *args: Any,
                  **kwargs: Any) -> Any:
        fed.append((request_id, list(prompt)))
        return add_request(self, request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    engine = ["--model", str(tiny_llama_dir), "--load-format", "dummy", "--device", "cpu",
              "--num-kv-blocks", "64", "--no-progress", "--max-model-len", "200"]
    assert cli_main(["bench", "throughput", *engine, "--dataset", "sharegpt-like",
                     "--num-prompts", "5", "--seed", "3", "--num-iters-warmup", "1",
                     "--save-prompts", str(tmp_path / "t.jsonl"),
                     "--output-json", str(tmp_path / "ms_t.json")]) == 0
    assert cli_main(["bench", "latency", *engine, "--input-len", "6", "--output-len", "4",
                     "--num-iters", "2", "--num-iters-warmup", "1",
                     "--save-prompts", str(tmp_path / "l.jsonl"),
                     "--output-json", str(tmp_path / "ms_l.json")]) == 0
    assert peer.main(["run", "--model", str(tiny_llama_dir), "--throughput-prompts",
                      str(tmp_path / "t.jsonl"), "--latency-prompts", str(tmp_path / "l.jsonl"),
                      "--latency-warmup", "1", "--output-json", str(tmp_path / "v.json")]) == 0
    generates = [c for c in fake_vllm.CALLS if c[0] == "generate"]
    timed_tput, lat_runs = generates[1], generates[2::2]
    assert timed_tput[1] == [p for rid, p in fed if rid.startswith("tput-")]
    ms_t = json.loads((tmp_path / "ms_t.json").read_text())
    assert sum(p["max_tokens"] for p in timed_tput[2]) == ms_t["output_tokens"]
    assert [c[1][0] for c in lat_runs] == [p for rid, p in fed if rid.startswith("lat")]
    summary, table = peer.side_by_side(tmp_path / "v.json", tmp_path / "ms_t.json",
                                       tmp_path / "ms_l.json")
    assert all(summary["same_workload"].values()), summary["same_workload"]
    assert all(row["ratio"] is not None for row in summary["rows"]), table
