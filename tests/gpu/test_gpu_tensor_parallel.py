"""Tensor parallelism on 2 GPUs: a tiny random Llama (float32) with CUDA graphs and the
overlapped loop gives at TP=2 the greedy tokens of TP=1, request for request; the logprobs'
largest difference goes to $GPU_TEST_OUT/tensor_parallel.json. Skipped with fewer than two
GPUs. Run by `bash loadtest/gpu.sh tests` and by the part `tp` (step `check`).
"""

from __future__ import annotations

import random
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


def run(folder: Path, prompts: list[list[int]], tp: int) -> tuple[Tokens, Logprobs, bool]:
    """Greedy tokens and chosen-token logprobs per request, and whether CUDA graphs ran."""
    engine = build_engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=512,
                                    max_num_seqs=8, tensor_parallel_size=tp))
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
    two, two_lp, graphs = run(folder, prompts, 2)
    same = sum(one[k] == two[k] for k in one)
    diff = max((abs(a - b) for k in one if one[k] == two[k]
                for a, b in zip(one_lp[k], two_lp[k])), default=0.0)
    record("tensor_parallel", {"requests": len(one), "identical_tokens": same,
                               "max_logprob_diff": diff, "cuda_graphs": graphs})
    assert same == len(one), f"{len(one) - same} of {len(one)} requests differ at TP=2"
