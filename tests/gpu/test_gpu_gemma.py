"""Gemma 2 and Gemma 3 on the GPU: tiny models' greedy outputs on CUDA (eager, and with the
decode and piecewise CUDA graphs) against the CPU path. Prompts run past the tiny models'
sliding windows (8 and 12 tokens), so windowed and global layers, Gemma 2's attention
soft-capping and Gemma 3's local RoPE base all run in the Triton attention kernel and in the
graphs. Figures go to $GPU_TEST_OUT/gemma_paths_*.json.

In float32 the tokens must be the CPU path's exactly; bfloat16 is recorded beside them and
held to the suite's bf16 logprob bound on the shared prefix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_record import record
from test_gpu_engine_paths import BF16_LOGPROB_TOL, FP32_LOGPROB_TOL, compare, run
from tiny_models import build_tiny_model


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gpu_gemma_paths_match_cpu(arch: str, tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, arch, seed=5, max_position_embeddings=1024)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 40, 130, 3, 77)]
    cpu = run(folder, "cpu", "float32", True, prompts, 24)
    row = {}
    for name, dtype, eager in (("cuda_eager_fp32", "float32", True),
                               ("cuda_graphs_fp32", "float32", False),
                               ("cuda_graphs_bf16", "bfloat16", False)):
        got = run(folder, "cuda", dtype, eager, prompts, 24)
        fp32 = dtype == "float32"
        row[name] = compare(cpu, got, FP32_LOGPROB_TOL if fp32 else BF16_LOGPROB_TOL,
                            exact_tokens=fp32)
    record(f"gemma_paths_{arch}", {"gpu": torch.cuda.get_device_name(0), **row})
    failures = [f"{name}: {failure}" for name, figures in row.items() if "fp32" in name
                for failure in figures["failures"]]  # type: ignore[attr-defined]
    assert not failures, "\n".join(failures[:20])
