"""ShardPlan: each rank's shapes and checkpoint slices (pure arithmetic and file reads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import build_tiny_model

from meshserve.services.worker.loader import (
    _iter_checkpoint,
    checkpoint_files,
    load_model,
    load_model_config,
    resolve_model,
)
from meshserve.services.worker.models.llama import RMSNorm
from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan
from meshserve.services.worker.parallel.layers import SummingNorm, VocabParallelEmbedding
from meshserve.shared.errors import ModelLoadError


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads of 16, 2 KV heads, intermediate 128, vocabulary 451, o_proj bias; 3 shards.
    return build_tiny_model(tmp_path_factory.mktemp("shards"), "llama", seed=0, shards=3,
                            vocab_size=451, attention_bias=True)


def plan(folder: Path, rank: int, world: int = 2) -> ShardPlan:
    config = load_model_config(resolve_model(str(folder), "auto"))
    return ShardPlan(config, ParallelConfig(world_size=world, rank=rank))


def full_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensors[name] = f.get_tensor(name)
    return tensors


def test_each_rank_reads_only_its_slices_and_they_rebuild_the_checkpoint(folder: Path) -> None:
    files = checkpoint_files(folder)
    assert len(files) == 3
    full = full_tensors(folder)
    ranks = [dict(_iter_checkpoint(files, plan(folder, r))) for r in (0, 1)]
    layer = "model.layers.1."
    shapes = {name: tuple(ranks[1][layer + name].shape) for name in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight")}
    assert shapes == {"self_attn.q_proj.weight": (32, 64), "self_attn.k_proj.weight": (16, 64),
                      "self_attn.o_proj.weight": (64, 32), "mlp.gate_proj.weight": (64, 64),
                      "mlp.down_proj.weight": (64, 64), "input_layernorm.weight": (64,)}
    for name in ("self_attn.q_proj.weight", "self_attn.v_proj.bias", "mlp.up_proj.weight"):
        rebuilt = torch.cat([ranks[0][layer + name], ranks[1][layer + name]], dim=0)
        assert torch.equal(rebuilt, full[layer + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        rebuilt = torch.cat([ranks[0][layer + name], ranks[1][layer + name]], dim=1)
        assert torch.equal(rebuilt, full[layer + name])
    bias = layer + "self_attn.o_proj.bias"  # added once: rank 0 holds it, rank 1 zeros
    assert torch.equal(ranks[0][bias], full[bias]) and not ranks[1][bias].any()
    # 451 rows -> 226 per rank; rank 1's last row is padding.
    embed = [ranks[r]["model.embed_tokens.weight"] for r in (0, 1)]
    assert [tuple(e.shape) for e in embed] == [(226, 64), (226, 64)]
    assert torch.equal(torch.cat(embed)[:451], full["model.embed_tokens.weight"])
    assert not embed[1][-1].any()


def test_a_rank_builds_a_model_of_its_own_shapes(folder: Path) -> None:
    shard = plan(folder, 1)
    source = resolve_model(str(folder), "auto")
    model = load_model(source, shard.model, torch.float32, torch.device("cpu"), "auto",
                       shard=shard)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert tuple(attn.qkv_proj.weight.shape) == (64, 64)  # (2 + 2 * 1) heads x 16
    assert tuple(model.model.layers[0].mlp.gate_up_proj.weight.shape) == (128, 64)
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    assert model.model.embed_tokens.start == 226
    assert tuple(model.lm_head.weight.shape) == (226, 64)
    # Every norm that adds a row-parallel output sums it over the ranks first, numbered in
    # the order a forward pass reaches them; layer 0's input norm adds nothing.
    layers = model.model.layers
    summing = [norm for layer in layers
               for norm in (layer.input_layernorm, layer.post_attention_layernorm)
               if isinstance(norm, SummingNorm)] + [model.model.norm]
    assert type(layers[0].input_layernorm) is RMSNorm
    assert [n.site for n in summing] == list(range(2 * len(layers)))
    assert model.rank_sum.sites == 2 * len(layers)
    assert all(isinstance(n, SummingNorm) for n in summing)
    full = full_tensors(folder)
    assert torch.equal(layers[1].input_layernorm.weight,
                       full["model.layers.1.input_layernorm.weight"])
    assert torch.equal(model.model.norm.weight, full["model.norm.weight"])
    # No forward hooks remain on the row-parallel projections: the sums are the norms'.
    assert not layers[0].self_attn.o_proj._forward_hooks
    assert not layers[0].mlp.down_proj._forward_hooks


def test_kv_heads_are_replicated_when_fewer_than_ranks(folder: Path) -> None:
    config = plan(folder, 0).model  # 2 KV heads
    quads = [ShardPlan(config, ParallelConfig(world_size=4, rank=r)) for r in range(4)]
    assert [(q.kv_heads_per_rank, q.first_kv_head) for q in quads] == [
        (1, 0), (1, 0), (1, 1), (1, 1)]
    assert [q.heads_per_rank for q in quads] == [1, 1, 1, 1]


@pytest.mark.parametrize("world", [3, 8])
def test_sizes_that_do_not_split_are_refused_by_name(folder: Path, world: int) -> None:
    config = plan(folder, 0).model
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size") as refused:
        ShardPlan(config, ParallelConfig(world_size=world, rank=0))
    assert refused.value.param == "tensor_parallel_size"
