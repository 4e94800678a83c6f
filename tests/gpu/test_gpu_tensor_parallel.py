"""Tensor parallelism on 2 GPUs: a tiny random Llama (float32) with CUDA graphs and the
overlapped loop gives at TP=2 the greedy tokens of TP=1, request for request; the logprobs'
largest difference goes to $GPU_TEST_OUT/tensor_parallel.json. Tiny Qwen3-MoE and Qwen2-MoE
models do the same at TP=2 (experts split) and at TP=2 with expert parallelism (whole
experts per GPU), in $GPU_TEST_OUT/tensor_parallel_<arch>.json. Skipped with fewer than two
GPUs. Run by `bash loadtest/gpu.sh tests` and by the part `tp` (step `check`).

A process runs one NCCL engine until it exits (services/worker/parallel/ranks.py), so each
TP=2 engine runs in a fresh process of its own (`run_apart`).
"""

from __future__ import annotations

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from gpu_record import record
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

Tokens = dict[str, list[int]]
Logprobs = dict[str, list[float]]


def run(folder: Path, prompts: list[list[int]], tp: int,
        **overrides: object) -> tuple[Tokens, Logprobs, bool]:
    """Greedy tokens and chosen-token logprobs per request, and whether CUDA graphs ran."""
    engine = build_engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=512,
                                    max_num_seqs=8, tensor_parallel_size=tp,
                                    **overrides))  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: Tokens = {}
    logprobs: Logprobs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            logprobs.setdefault(o.request_id, []).extend(
                lp.logprob for lp in o.new_logprobs or [])
    graphs = engine.graph_report is not None
    engine.close()
    return tokens, logprobs, graphs


def run_apart(folder: Path, prompts: list[list[int]], tp: int,
              **overrides: object) -> tuple[Tokens, Logprobs, bool]:
    """`run` in a new process (spawned: CUDA and NCCL start fresh there)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        return pool.submit(run, folder, prompts, tp, **overrides).result()


def test_tp2_matches_tp1(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    folder = build_tiny_model(tmp_path, "llama", seed=3, vocab_size=1027, hidden_size=512,
                              intermediate_size=1024, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
                              max_position_embeddings=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1027) for _ in range(n)] for n in (5, 40, 130, 7, 300, 64)]
    one, one_lp, _ = run(folder, prompts, 1)
    two, two_lp, graphs = run_apart(folder, prompts, 2)
    same = sum(one[k] == two[k] for k in one)
    diff = max((abs(a - b) for k in one if one[k] == two[k]
                for a, b in zip(one_lp[k], two_lp[k])), default=0.0)
    record("tensor_parallel", {"requests": len(one), "identical_tokens": same,
                               "max_logprob_diff": diff, "cuda_graphs": graphs})
    assert same == len(one), f"{len(one) - same} of {len(one)} requests differ at TP=2"


def agreement(one: Tokens, one_lp: Logprobs, two: Tokens, two_lp: Logprobs) -> dict[str, float]:
    same = sum(one[k] == two[k] for k in one)
    diff = max((abs(a - b) for k in one if one[k] == two[k]
                for a, b in zip(one_lp[k], two_lp[k])), default=0.0)
    return {"identical_tokens": same, "max_logprob_diff": diff}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_tp2_and_expert_parallel_match_tp1(arch: str, tmp_path: Path) -> None:
    """16 experts (top 4) of intermediate 256: at TP=2 each GPU holds half of every
    expert; with --enable-expert-parallel GPU r holds experts 8r..8r+7 whole."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    folder = build_tiny_model(tmp_path, arch, seed=3, vocab_size=1027, hidden_size=512,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                              num_hidden_layers=3, max_position_embeddings=1024,
                              num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1027) for _ in range(n)] for n in (5, 40, 130, 7, 300, 64)]
    one, one_lp, _ = run(folder, prompts, 1)
    split, split_lp, graphs = run_apart(folder, prompts, 2)
    placed, placed_lp, _ = run_apart(folder, prompts, 2, enable_expert_parallel=True)
    figures = {"requests": len(one), "cuda_graphs": graphs,
               "tp2": agreement(one, one_lp, split, split_lp),
               "tp2_expert_parallel": agreement(one, one_lp, placed, placed_lp)}
    record(f"tensor_parallel_{arch}", figures)
    for name in ("tp2", "tp2_expert_parallel"):
        same = figures[name]["identical_tokens"]  # type: ignore[index]
        assert same == len(one), f"{name}: {len(one) - same} of {len(one)} requests differ"
