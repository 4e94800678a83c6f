"""loadtest/fp8_logprobs.py (the GPU record of FP8 logprobs against bf16) on the CPU with a
one-layer model: it runs its five engines, writes every pair's figures, and the figures
order as rounding says they must (FP8 weights move logprobs more than bf16 does)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_logprobs_script_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "fp8_logprobs.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "fp8_logprobs.py"), "--out", str(out),
         "--device", "cpu", "--layers", "1", "--prompts", "2", "--length", "12"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["pairs"]) == {"bf16 -> fp8", "bf16 -> fp8_kv8", "bf16 -> fp8_head",
                                    "float32 -> bf16", "float32 -> fp8", "float32 -> fp8_kv8",
                                    "float32 -> fp8_head"}
    for figures in result["pairs"].values():
        assert figures["logprob_positions"] == 2 * 11  # every prompt position after the first
        assert figures["decode_tokens"] == 2 * 12
        assert math.isfinite(figures["logprob_token_mean_abs_diff"])
    pairs = result["pairs"]
    # e4m3 keeps 3 mantissa bits, bf16 8: FP8 weights move the prompt logprobs further.
    assert (pairs["float32 -> fp8"]["logprob_token_mean_abs_diff"]
            > pairs["float32 -> bf16"]["logprob_token_mean_abs_diff"] > 0)
