"""Speculative decoding with a draft model at tensor parallelism (CPU, gloo, 2 ranks): the
draft is whole on rank 0, which alone drafts; both ranks run the verify passes. Greedy
output is transformers' token for token (transformers + peft's with LoRA adapters)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from engine_features import speculation_of
from lora_adapters import build_adapter, greedy, peft_model
from test_engine_vs_hf import hf_greedy, run_all, tokens_of
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.lora_config import LoraModule
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
    engine = build_engine(EngineConfig(
        model=str(target), dtype="float32", device="cpu", num_kv_blocks=96,
        tensor_parallel_size=2, structured_outputs_backend="none", speculative_config=spec,
        async_scheduling=async_scheduling, max_num_batched_tokens=32))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (6, 29, 13)]
    try:
        assert engine.ranks is not None and speculation_of(engine) is not None
        outputs = run_all(engine, prompts, GREEDY)
        drafts, drafted, accepted, _ = speculation_of(engine).stats.snapshot()
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i}"
    assert drafts > 0 and drafted > 0
    if draft == "twin":  # the target's own greedy tokens, drafted by rank 0's whole copy
        assert accepted == drafted
        steps = sum(len(outputs[f"r{i}"]) for i in range(len(prompts)))
        assert steps < len(prompts) * MAX_NEW, "accepted drafts must save steps"


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_adapters_with_a_draft_model(models: tuple[Path, Path, Path], tmp_path: Path,
                                          tp: int) -> None:
    """The draft drafts as its base model; the verify pass applies each row's adapter, so
    every row keeps its own model's greedy tokens."""
    target, twin, _ = models
    adapter = build_adapter(target, tmp_path / "a", seed=40, rank=8)
    module = LoraModule("ad", str(adapter))
    engine = build_engine(EngineConfig(
        model=str(target), dtype="float32", device="cpu", num_kv_blocks=96,
        tensor_parallel_size=tp, structured_outputs_backend="none", enable_lora=True,
        lora_modules=f"{module.name}={module.path}", max_num_batched_tokens=32,
        speculative_config=json.dumps({"model": str(twin), "num_speculative_tokens": 3})))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    references = [hf, peft_model(target, adapter)]
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (9, 17, 24, 5)]
    try:
        got: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY,
                               lora_id=module.lora_id if i % 2 else None)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert speculation_of(engine) is not None
        _, drafted, accepted, _ = speculation_of(engine).stats.snapshot()
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == greedy(references[i % 2], prompt, MAX_NEW), f"request {i}"
    # The base rows' drafts (the target's twin) are all right; the adapter rows' are not.
    assert 0 < accepted < drafted
