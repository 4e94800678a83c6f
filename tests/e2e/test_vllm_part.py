"""The GPU driver's part `vllm` on CPU: `meshserve bench` on a tiny model, then
loadtest/vllm_offline.py on a stand-in `vllm` installed from parts as on a GPU machine, on the
prompts meshserve saved; the side-by-side summary at the end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from vllm_stand_in import ENV, FAKE_VLLM, REPO, fetched, installer


def test_the_part_runs_both_engines_on_the_same_prompts(tmp_path: Path,
                                                        tiny_llama_dir: Path) -> None:
    src = fetched(tmp_path, FAKE_VLLM)
    store = tmp_path / "store"
    assert installer("stash", src, store).returncode == 0
    assert installer("install", store).returncode == 0
    (tmp_path / "nothing").mkdir()
    out, run_root = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    run_root.mkdir()
    knobs = {"OUT": str(out), "RUN_ROOT": str(run_root), "MESHSERVE_CLI": "meshserve.cli.main",
             "VLLM_STORE": str(store), "VLLM_CARRIED": str(tmp_path / "nothing"),
             "MODEL_DIR": str(tiny_llama_dir), "VLLM_PROMPTS": "4", "MAX_MODEL_LEN": "200",
             "LATENCY_LEN": "4", "LATENCY_ITERS": "2", "LATENCY_WARMUP": "1",
             "ENGINE_FLAGS": "--device cpu --num-kv-blocks 64", "VLLM_CHECK_MODULES": "vllm"}
    body = "set -uo pipefail; . loadtest/gpu/env.sh; gpu_part_dirs vllm; . loadtest/gpu/vllm.sh"
    done = subprocess.run(["bash", "-c", body], cwd=REPO, capture_output=True, text=True,
                          check=False, env={**ENV, **knobs})
    steps = (out / "vllm" / "steps.log").read_text() if (out / "vllm").is_dir() else ""
    assert done.returncode == 0, done.stdout + done.stderr + steps
    for step in ("vllm_check", "ms_sharegpt", "ms_latency", "vllm", "report"):
        assert f"== {step}: exit 0" in steps, steps
    summary = json.loads((out / "vllm" / "summary.json").read_text())
    assert all(summary["same_workload"].values()), summary
    vllm_run = json.loads((out / "vllm" / "vllm.json").read_text())
    assert vllm_run["llm_kwargs"]["max_model_len"] == 200
    assert vllm_run["llm_kwargs"]["gpu_memory_utilization"] == 0.9
    assert vllm_run["throughput"]["num_requests"] == 4 and vllm_run["latency"]["num_iters"] == 2
    assert "| output tokens/s |" in (out / "vllm" / "summary.md").read_text()
