"""Gemma 2 and Gemma 3 on the GPU: tiny models' greedy outputs on CUDA (eager, and with the
decode and piecewise CUDA graphs) against the CPU path. Prompts run past the tiny models'
sliding windows (8 and 12 tokens), so windowed and global layers, Gemma 2's attention
soft-capping and Gemma 3's local RoPE base all run in the Triton attention kernel and in the
graphs. Figures go to $GPU_TEST_OUT/gemma_paths_*.json.

In float32 the tokens must be the CPU path's exactly; bfloat16 is recorded beside them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_gpu_engine_paths import fp32_failures_against_cpu
from tiny_models import build_tiny_model


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gpu_gemma_paths_match_cpu(arch: str, tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, arch, seed=5, max_position_embeddings=1024)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 9, 40, 130, 3, 77)]
    failures = fp32_failures_against_cpu(folder, prompts, 24, f"gemma_paths_{arch}")
    assert not failures, "\n".join(failures[:20])
