"""Mixtures of experts over tensor-parallel ranks: where each expert goes, how a rank's
routing is remapped to its own experts, how the checkpoint's expert tensors (one by one or
stacked) are sliced or placed, and the --enable-expert-parallel flag
(services/worker/parallel/experts.py; end to end in tests/engine/test_tensor_parallel_moe.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_tiny_model

from meshserve.kernels.moe import fused_experts_reference, route
from meshserve.services.worker.config import EngineConfig, WorkerConfig, short_flags
from meshserve.services.worker.loader import ModelSource, load_model, load_model_config
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.moe import SparseMoeBlock
from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan
from meshserve.services.worker.parallel.experts import ExpertPlacement, local_routing
from meshserve.shared.errors import ConfigError, ModelLoadError

BASE: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def plan(world: int, rank: int = 0, ep: bool = False, **fields: Any) -> ShardPlan:
    config = ModelConfig.from_hf({**BASE, **fields})
    return ShardPlan(config, ParallelConfig(world_size=world, rank=rank, expert_parallel=ep))


def test_each_rank_holds_a_contiguous_block_of_whole_experts() -> None:
    ranks = [ExpertPlacement(8, 2, r) for r in (0, 1)]
    assert [list(p.experts_of(p.rank)) for p in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.first for p in ranks] == [0, 4]
    assert [ranks[0].owner(e) for e in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [ranks[1].local_id(e) for e in range(8)] == [None] * 4 + [0, 1, 2, 3]
    assert [ranks[0].local_id(e) for e in range(8)] == [0, 1, 2, 3] + [None] * 4
    big = ExpertPlacement(128, 4, 3)
    assert (big.per_rank, big.first, big.experts_of(3)) == (32, 96, range(96, 128))


def test_experts_that_do_not_split_evenly_are_refused_naming_both_numbers() -> None:
    with pytest.raises(ModelLoadError, match="60 experts.*--tensor-parallel-size 8") as no:
        ExpertPlacement(60, 8)
    assert no.value.param == "enable_expert_parallel"
    with pytest.raises(ModelLoadError, match="8 experts.*--tensor-parallel-size 3"):
        plan(3, ep=True, num_attention_heads=6, num_key_value_heads=3,
             shared_expert_intermediate_size=48, moe_intermediate_size=30)


def test_local_routing_zeroes_other_ranks_pairs_and_numbers_its_own_from_zero() -> None:
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    ids = torch.tensor([[1, 6], [5, 4], [7, 3]], dtype=torch.int32)
    w, local = local_routing(weights, ids, first=4, count=4)
    assert local.dtype == torch.int32 and local.shape == ids.shape
    assert local.tolist() == [[-1, 2], [1, 0], [3, -1]]  # -1: skipped by the kernels
    assert w.tolist() == [[0.0, 0.4000000059604645], [0.699999988079071, 0.30000001192092896],
                          [0.5, 0.0]]


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_partial_outputs_sum_to_the_whole_layers(world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    experts, hidden, inter, tokens = 8, 16, 12, 9
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.float64)
    w2 = torch.randn(experts, hidden, inter, generator=gen, dtype=torch.float64)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), 3, renormalize=True)
    whole = fused_experts_reference(x, w13, w2, weights, ids)
    parts = []
    for rank in range(world):
        mine = ExpertPlacement(experts, world, rank)
        held = slice(mine.first, mine.first + mine.per_rank)
        w, local = local_routing(weights, ids, mine.first, mine.per_rank)
        parts.append(fused_experts_reference(x, w13[held], w2[held], w, local))
    torch.testing.assert_close(sum(parts), whole)
    assert all(part.abs().sum() > 0 for part in parts)  # every rank had pairs of its own


def test_shapes_of_a_rank_split_or_placed() -> None:
    split = plan(2, rank=1).local_config()
    assert (split.num_experts, split.moe_intermediate_size,
            split.shared_expert_intermediate_size, split.intermediate_size) == (8, 16, 24, 48)
    placed = plan(2, rank=1, ep=True)
    assert placed.expert_parallel and placed.placement.first == 4
    assert (placed.local_config().num_experts, placed.local_config().moe_intermediate_size,
            placed.local_config().shared_expert_intermediate_size) == (8, 32, 24)


def test_sizes_that_do_not_split_are_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="moe_intermediate_size 33.*--enable-expert-para"):
        plan(2, moe_intermediate_size=33)
    plan(2, ep=True, moe_intermediate_size=33)  # whole experts: their size is not split
    with pytest.raises(ModelLoadError, match="shared_expert_intermediate_size 51"):
        plan(2, ep=True, shared_expert_intermediate_size=51)
    # Mixtral has no dense MLP: its intermediate_size (its experts') is only checked when
    # the experts are split.
    mixtral = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
               "intermediate_size": 33}
    plan(2, ep=True, **mixtral)
    with pytest.raises(ModelLoadError, match="moe_intermediate_size 33"):
        plan(2, **mixtral)


def test_expert_names_are_renamed_to_the_ranks_experts_and_others_dropped() -> None:
    ranks = [plan(2, rank=r, ep=True) for r in (0, 1)]
    mixtral = "model.layers.3.block_sparse_moe.experts.{}.w2.weight"
    assert [ranks[1].local_name(mixtral.format(e)) for e in (3, 4, 7)] == [
        None, mixtral.format(0), mixtral.format(3)]
    assert ranks[0].local_name(mixtral.format(3)) == mixtral.format(3)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.0.mlp.shared_expert.up_proj.weight", "lm_head.weight"):
        assert ranks[1].local_name(name) == name
    # Without expert parallelism (or on a dense model) every name is kept as it is.
    name = "model.layers.0.mlp.experts.6.up_proj.weight"
    assert plan(2, rank=1).local_name(name) == name
    dense = ShardPlan(ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]}),
                      ParallelConfig(world_size=2, expert_parallel=True))
    assert not dense.expert_parallel and dense.local_name(name) == name


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen2-MoE folder (experts one by one) and a copy with stacked experts."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    single = build_tiny_model(tmp_path_factory.mktemp("single"), "qwen2_moe", seed=2)
    stacked = Path(shutil.copytree(single, tmp_path_factory.mktemp("x") / "stacked"))
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (stacked / "model.safetensors").unlink()
    save_file(state, str(stacked / "model.safetensors"))
    return single, stacked


def blocks(folder: Path, rank: int | None, ep: bool = False) -> list[SparseMoeBlock]:
    """The sparse blocks of rank `rank` of 2 (None: the whole model), loaded in-process."""
    source = ModelSource(str(folder), folder, "hf", None)
    config = load_model_config(source)
    shard = None if rank is None else ShardPlan(
        config, ParallelConfig(world_size=2, rank=rank, expert_parallel=ep))
    model = load_model(source, config, torch.float32, torch.device("cpu"), "auto", shard=shard)
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("ep", [False, True])
def test_both_checkpoint_forms_give_each_rank_the_same_part_of_the_whole(
        folders: tuple[Path, Path], ep: bool) -> None:
    single, stacked = folders
    whole = blocks(single, None)
    ranks = [blocks(single, r, ep) for r in (0, 1)]
    for r in (0, 1):
        for a, b in zip(ranks[r], blocks(stacked, r, ep), strict=True):
            for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(),
                                         strict=True):
                assert torch.equal(p, q), (r, name)
    inter = whole[0].experts.w2.shape[2]
    for full, zero, one in zip(whole, *ranks, strict=True):
        if ep:  # whole experts, rank 0's first
            assert torch.equal(torch.cat([zero.experts.w13, one.experts.w13]), full.experts.w13)
            assert torch.equal(torch.cat([zero.experts.w2, one.experts.w2]), full.experts.w2)
        else:  # gate rows, then up rows, each split; down's columns split
            gate = torch.cat([zero.experts.w13[:, : inter // 2], one.experts.w13[:, : inter // 2]],
                             dim=1)
            up = torch.cat([zero.experts.w13[:, inter // 2 :], one.experts.w13[:, inter // 2 :]],
                           dim=1)
            assert torch.equal(torch.cat([gate, up], dim=1), full.experts.w13)
            assert torch.equal(torch.cat([zero.experts.w2, one.experts.w2], dim=2),
                               full.experts.w2)
        assert torch.equal(zero.gate.weight, full.gate.weight)  # routers replicated
        assert zero.shared_expert_gate is not None and full.shared_expert_gate is not None
        assert torch.equal(zero.shared_expert_gate.weight, full.shared_expert_gate.weight)
        assert zero.shared_expert is not None and full.shared_expert is not None
        assert torch.equal(torch.cat([zero.shared_expert.down_proj.weight,
                                      one.shared_expert.down_proj.weight], dim=1),
                           full.shared_expert.down_proj.weight)


def test_the_flag_needs_more_than_one_rank_and_takes_vllms_spellings() -> None:
    with pytest.raises(ConfigError, match="needs --tensor-parallel-size above 1") as no:
        EngineConfig(model="m", enable_expert_parallel=True)
    assert no.value.param == "enable_expert_parallel"
    assert EngineConfig(model="m", enable_expert_parallel=True,
                        tensor_parallel_size=2).enable_expert_parallel
    assert not EngineConfig(model="m", tensor_parallel_size=2).enable_expert_parallel
    worker = WorkerConfig.from_args(short_flags(["-tp", "2", "-ep"]), environ={})
    assert (worker.tensor_parallel_size, worker.enable_expert_parallel) == (2, True)
    assert WorkerConfig.from_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"],
                                  environ={}).enable_expert_parallel


def test_serve_and_up_hand_the_flag_to_their_workers() -> None:
    from meshserve.cli.up import positional_model
    from meshserve.cli.vllm_options import translate
    from meshserve.local.launcher import LauncherConfig

    def config_of(*argv: str) -> LauncherConfig:
        return LauncherConfig.from_args(translate(positional_model(argv)), environ={})

    for flags in (["--enable-expert-parallel"], ["-ep"]):
        config = config_of("m", "-tp", "2", *flags)
        assert config.enable_expert_parallel
        assert "--enable-expert-parallel" in config.engine_flags()
    # vLLM's data-parallel replicas with expert parallelism are meshserve's --workers, which
    # share no experts: refused by name rather than run as something else.
    with pytest.raises(ConfigError, match="enable-expert-parallel"):
        config_of("m", "--data-parallel-size", "2", "--enable-expert-parallel")
