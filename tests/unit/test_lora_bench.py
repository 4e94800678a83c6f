"""loadtest/lora_bench.py on the CPU with a small Llama-3.1-shaped dummy model: its adapters
change the model's tokens (the consistency check can tell an applied adapter from an ignored
one), and every subcommand the GPU script runs parses and writes its figures."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
COUNT, RANK = 2, 8


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lora_bench", ROOT / "loadtest" / "lora_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_bench"] = module
    spec.loader.exec_module(module)
    return module


lora_bench = _bench()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8B config scaled down (same vocabulary, head size and dummy weights)."""
    folder = tmp_path_factory.mktemp("lora_bench") / "model"
    folder.mkdir()
    config = json.loads((ROOT / "loadtest/models/llama-3.1-8b/config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=2,
                  num_key_value_heads=1, num_hidden_layers=2, vocab_size=8192,
                  bos_token_id=1, eos_token_id=[2])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


ENGINE = ["--model", "", "--load-format", "dummy", "--dtype", "float32", "--device", "cpu",
          "--num-kv-blocks", "64", "--max-model-len", "256"]


def _run_args(model: Path, adapters: Path | None, *extra: str) -> list[str]:
    engine = [str(model) if arg == "" else arg for arg in ENGINE]
    lora = [] if adapters is None else ["--adapters", str(adapters), "--count", str(COUNT),
                                        "--rank", str(RANK)]
    return ["run", *engine, *lora, *extra]


def _consistency(model: Path, adapters: Path, out: Path) -> dict[str, float]:
    lora_bench.main(_run_args(model, adapters, "--enforce-eager", "--consistency-only",
                              "--out", str(out)))
    checks: dict[str, float] = json.loads(out.read_text())["consistency"]
    return checks


def test_bench_adapters_change_the_dummy_models_tokens(model: Path, tmp_path: Path) -> None:
    adapters = tmp_path / "adapters"
    lora_bench.main(["adapters", "--model", str(model), "--out", str(adapters),
                     "--count", str(COUNT), "--rank", str(RANK)])
    checks = _consistency(model, adapters, tmp_path / "eager.json")
    assert checks["same_alone_and_mixed"] == 1.0
    assert checks["differs_from_base"] == 1.0
    # The direct signal: the first position's logits move by a good part of their spread,
    # more than the top-2 gap that a changed greedy token needs.
    assert checks["max_logit_diff"] > max(checks["base_top2_gap"],
                                          0.2 * checks["base_logit_std"])
    # On the CPU the hooks run the grouped torch path already: the same logits exactly.
    assert checks["kernel_vs_reference_max_logit_diff"] == 0.0
    logits = torch.load(tmp_path / "eager.json.logits.pt")
    assert logits.shape == (1 + COUNT, 8192)


def test_adapters_that_only_double_a_projection_leave_the_tokens(model: Path,
                                                                 tmp_path: Path) -> None:
    """Why the bench's adapters are of unit gain: with B ~ 0.01 (twice a dummy projection's
    output) they are applied and the logits move, yet by less than the top-2 gap, so no
    greedy token changes and a check on tokens alone cannot tell them from ignored ones."""
    adapters = tmp_path / "adapters"
    lora_bench.write_adapters(model, adapters, COUNT, RANK)
    for i in range(COUNT):
        path = adapters / f"lora{i}" / "adapter_model.safetensors"
        tensors = load_file(str(path))
        save_file({key: (t.float() * (0.01 * RANK**0.5)).bfloat16() if ".lora_B." in key
                   else t for key, t in tensors.items()}, str(path))
    checks = _consistency(model, adapters, tmp_path / "weak.json")
    assert checks["differs_from_base"] == 0.0
    assert 0 < checks["max_logit_diff"] < checks["base_top2_gap"]


def test_gpu_script_steps_on_cpu(model: Path, tmp_path: Path) -> None:
    """base, lora (two passes each), eager consistency and the summary with all of them."""
    adapters = tmp_path / "adapters"
    lora_bench.write_adapters(model, adapters, COUNT, RANK)
    small = ["--num-prompts", "3", "--single-input-len", "8", "--single-output-len", "4"]
    lora_bench.main(_run_args(model, None, *small, "--out", str(tmp_path / "base.json")))
    lora_bench.main(_run_args(model, adapters, *small, "--out", str(tmp_path / "lora.json")))
    _consistency(model, adapters, tmp_path / "eager.json")
    lora_bench.main(["summary", "--base", str(tmp_path / "base.json"), "--lora",
                     str(tmp_path / "lora.json"), "--eager", str(tmp_path / "eager.json"),
                     "--out-md", str(tmp_path / "summary.md"),
                     "--out-json", str(tmp_path / "all.json")])
    result = json.loads((tmp_path / "all.json").read_text())
    tput = result["lora"]["tput_lora"]
    assert len(tput["passes"]) == 2
    mean = sum(p["output_tokens_per_s"] for p in tput["passes"]) / 2
    assert tput["output_tokens_per_s"] == pytest.approx(mean)
    assert result["lora"]["consistency"]["differs_from_base"] == 1.0
    # No graphs on the CPU: the "graph" run and the eager one compute the same logits.
    assert result["graphs_vs_eager_max_logit_diff"] == {"base": 0.0, "adapters": 0.0}
    text = (tmp_path / "summary.md").read_text()
    assert "mean of 2 passes" in text and "eager: greedy tokens" in text
    row = next(line for line in text.splitlines() if line.startswith("| LoRA engine, 2 "))
    assert len(row.split("|")) == 6 and "-" not in row.split("|")[2]


def test_summary_of_a_run_cut_short(tmp_path: Path) -> None:
    """A lora step stopped by its limit leaves its consistency figures; the summary shows
    them, with "-" where throughput or TPOT are missing."""
    lora = {"command": {"count": 8, "rank": 16, "passes": 2},
            "environment": {"device": "cpu"},
            "consistency": {"same_alone_and_mixed": 1.0, "differs_from_base": 0.5}}
    (tmp_path / "lora.json").write_text(json.dumps(lora))
    lora_bench.main(["summary", "--base", str(tmp_path / "none.json"), "--lora",
                     str(tmp_path / "lora.json"), "--out-md", str(tmp_path / "s.md"),
                     "--out-json", str(tmp_path / "s.json")])
    text = (tmp_path / "s.md").read_text()
    assert "| LoRA engine, 8 adapters (rank 16) | - | - | - |" in text
    assert "differ from the base model for 50%" in text
    assert json.loads((tmp_path / "s.json").read_text())["ratio"] is None
