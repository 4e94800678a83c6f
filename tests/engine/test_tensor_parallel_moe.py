"""Mixtures of experts over two ranks on CPU (gloo): tensor parallelism (each expert's
intermediate dimension split) and expert parallelism (whole experts per rank) against one
rank, greedy tokens equal and logprobs within 1e-4 (float32), on a tiny Qwen3-MoE (a dense
layer 0, 8 experts) and Qwen2-MoE (a shared expert), as test_tensor_parallel.py runs the
dense models. Rank 1 is a real follower process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_tensor_parallel import logprobs, make_engine, prompts_for, run, tokens
from tiny_models import build_tiny_model

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.loader import checkpoint_files
from meshserve.services.worker.models.moe import SparseMoeBlock
from meshserve.services.worker.parallel.experts import ExpertSlice

Outputs = dict[str, list[SequenceOutput]]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        ) -> tuple[Path, Outputs]:
    """A tiny MoE folder (two safetensors shards) and one rank's outputs on it."""
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=4,
                              shards=2)
    return folder, run(make_engine(folder, 1), prompts_for(448))


def sparse_blocks(engine: LLMEngine) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in engine.runner.model.model.layers
            if isinstance(layer.mlp, SparseMoeBlock)]


def run_two_ranks(folder: Path, **overrides: object) -> tuple[Outputs, list[SparseMoeBlock]]:
    engine = make_engine(folder, 2, **overrides)
    try:
        return run(engine, prompts_for(448)), sparse_blocks(engine)
    finally:
        engine.close()


def assert_same(two: Outputs, one: Outputs) -> None:
    assert two.keys() == one.keys()
    for request in one:
        assert tokens(two[request]) == tokens(one[request]), request
        pairs = list(zip(logprobs(two[request]), logprobs(one[request]), strict=True))
        assert pairs, request
        for a, b in pairs:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        prompt_two = [e for e in two[request][0].prompt_logprobs or [] if e is not None]
        prompt_one = [e for e in one[request][0].prompt_logprobs or [] if e is not None]
        assert len(prompt_two) == len(prompt_one) > 0
        for a, b in zip(prompt_two, prompt_one, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_tensor_parallel_experts_match_one_rank(moe: tuple[Path, Outputs]) -> None:
    """Each rank holds all 8 experts with half of each one's intermediate dimension (and
    half of the shared expert's); the overlapped loop on."""
    folder, one = moe
    two, blocks = run_two_ranks(folder, async_scheduling="on")
    assert blocks and all(b.experts.w13.shape == (8, 2 * 16, 64) for b in blocks)
    assert all(b.experts.w2.shape == (8, 64, 16) for b in blocks)
    assert all(b.gate.weight.shape == (8, 64) for b in blocks)  # the router: replicated
    for block in blocks:
        if block.shared_expert is not None:
            assert block.shared_expert.down_proj.weight.shape == (64, 24)
    assert_same(two, one)


def checkpoint_down_projs(folder: Path, layer: int) -> list[torch.Tensor]:
    """The checkpoint's down_proj of each of layer `layer`'s 8 experts."""
    names = {f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight": e for e in range(8)}
    found: dict[int, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name in names:
                    found[names[name]] = f.get_tensor(name)
    return [found[e] for e in range(8)]


def test_expert_parallel_matches_one_rank(moe: tuple[Path, Outputs]) -> None:
    """Rank 0 holds experts 0..3 whole (rank 1 the others), routes over all 8, and runs
    only its own experts' pairs; the shared expert stays split."""
    folder, one = moe
    two, blocks = run_two_ranks(folder, enable_expert_parallel=True)
    assert blocks and all(isinstance(b.experts, ExpertSlice) for b in blocks)
    assert all(b.experts.w13.shape == (4, 2 * 32, 64) and b.experts.first == 0
               for b in blocks)
    assert all(b.gate.weight.shape == (8, 64) for b in blocks)
    for block in blocks:
        if block.shared_expert is not None:
            assert block.shared_expert.down_proj.weight.shape == (64, 24)
    # Rank 0's experts of the last layer are the checkpoint's experts 0..3, whole.
    last = json.loads((folder / "config.json").read_text())["num_hidden_layers"] - 1
    assert torch.equal(blocks[-1].experts.w2.detach(),
                       torch.stack(checkpoint_down_projs(folder, last)[:4]))
    assert_same(two, one)


def test_expert_parallel_on_a_dense_model_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As vLLM: the flag acts on mixture-of-experts layers only; a dense model runs as at
    plain tensor parallelism."""
    folder = build_tiny_model(tmp_path / "llama", "llama", seed=5)
    prompts = prompts_for(448)[:2]
    one = run(make_engine(folder, 1), prompts)
    with caplog.at_level(logging.WARNING, logger="meshserve.services.worker.builder"):
        engine = make_engine(folder, 2, enable_expert_parallel=True)
    try:
        two = run(engine, prompts)
    finally:
        engine.close()
    assert any("--enable-expert-parallel" in r.message and "has no experts" in r.message
               for r in caplog.records)
    assert {k: tokens(v) for k, v in two.items()} == {k: tokens(v) for k, v in one.items()}
