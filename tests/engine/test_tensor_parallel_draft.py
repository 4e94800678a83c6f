"""Speculative decoding with a draft model at tensor parallelism (CPU, gloo, 2 ranks): the
draft is whole on rank 0, which alone drafts; both ranks run the verify passes. Greedy
output is transformers' token for token."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from test_engine_vs_hf import hf_greedy, run_all, tokens_of
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.engine.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("tp-draft")
    target = build_tiny_model(root / "target", "llama", seed=1)
    twin = Path(shutil.copytree(target, root / "twin"))  # the same weights, another folder
    other = build_tiny_model(root / "other", "llama", seed=2, num_hidden_layers=1)
    return target, twin, other


@pytest.mark.parametrize(("draft", "async_scheduling"), [("twin", "off"), ("twin", "on"),
                                                         ("other", "on")])
def test_two_ranks_with_a_draft_model_keep_the_targets_greedy_tokens(
        models: tuple[Path, Path, Path], draft: str, async_scheduling: str) -> None:
    target, twin, other = models
    spec = json.dumps({"model": str(twin if draft == "twin" else other),
                       "num_speculative_tokens": 3})
    engine = LLMEngine(EngineConfig(
        model=str(target), dtype="float32", device="cpu", num_kv_blocks=96,
        tensor_parallel_size=2, structured_outputs_backend="none", speculative_config=spec,
        async_scheduling=async_scheduling, max_num_batched_tokens=32))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (6, 29, 13)]
    try:
        assert engine.ranks is not None and engine.spec is not None
        outputs = run_all(engine, prompts, GREEDY)
        drafts, drafted, accepted, _ = engine.spec.stats.snapshot()
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i}"
    assert drafts > 0 and drafted > 0
    if draft == "twin":  # the target's own greedy tokens, drafted by rank 0's whole copy
        assert accepted == drafted
        steps = sum(len(outputs[f"r{i}"]) for i in range(len(prompts)))
        assert steps < len(prompts) * MAX_NEW, "accepted drafts must save steps"
