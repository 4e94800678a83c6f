"""Reading a PEFT adapter folder into per-layer A and B tensors, checked against the model.

PEFT saves `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`
(some tools keep the adapter name: `.lora_A.default.weight`). A is [r, in], B is [out, r];
the adapter's scaling is folded into B here, so the kernels add x @ A^T @ B^T as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.parallel.config import ShardPlan
from meshserve.shared.errors import InvalidRequestError, NotFoundError
from meshserve.shared.lora_config import (
    WEIGHTS_FILE,
    LoraConfig,
    read_lora_config,
    refuse,
)

_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoraWeights:
    """One adapter on the host: A [r, in] and scaled B [out, r] per (layer, module)."""

    config: LoraConfig
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


# Projections whose inputs are split over tensor-parallel ranks (their outputs are summed).
_ROW_PARALLEL = ("o_proj", "down_proj")


def shard_lora_weights(weights: LoraWeights, shard: ShardPlan) -> LoraWeights:
    """This tensor-parallel rank's part of an adapter, split as the model's projections are.

    Column-parallel projections (q/k/v, gate/up): every rank's output rows are its own, so
    B [out, r] keeps this rank's rows and A [r, in] is whole. Row-parallel ones (o, down):
    the input is split, so A keeps this rank's columns and B is whole; each rank's delta
    x_r A_r^T B^T is then part of the sum over ranks the projection's output goes through.
    """
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for (layer, module), lora_a in weights.a.items():
        name = f"model.layers.{layer}.{module}.weight"  # as ShardPlan.take names it
        lora_b = weights.b[(layer, module)]
        if module in _ROW_PARALLEL:
            a[(layer, module)], b[(layer, module)] = shard.take(name, lora_a), lora_b
        else:
            a[(layer, module)], b[(layer, module)] = lora_a, shard.take(name, lora_b)
    return LoraWeights(weights.config, a, b)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of one decoder layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, config.q_size), "k_proj": (hidden, config.kv_size),
            "v_proj": (hidden, config.kv_size), "o_proj": (config.q_size, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def load_lora_weights(folder: str | Path, model: ModelConfig, max_rank: int) -> LoraWeights:
    """Read and check an adapter folder. NotFoundError for a missing folder or weights file,
    InvalidRequestError for an adapter this model cannot run (rank above `max_rank`, shapes
    that do not fit the model, tensors of modules the engine does not adapt)."""
    config = read_lora_config(folder)
    if config.rank > max_rank:
        raise InvalidRequestError(f"LoRA rank {config.rank} is above --max-lora-rank {max_rank}",
                                  param="lora_path")
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise NotFoundError(f"no {WEIGHTS_FILE} in the LoRA adapter folder {str(folder)!r}",
                            param="lora_path")
    shapes = module_shapes(model)
    weights = LoraWeights(config, {}, {})
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            match = _KEY.search(key)
            if match is None:
                raise refuse(f"tensor {key!r} is not a LoRA weight of a decoder projection")
            layer, module, which = int(match[1]), match[2], match[3]
            if module not in shapes or layer >= model.num_hidden_layers:
                raise refuse(f"tensor {key!r} adapts no projection of this model")
            tensor = f.get_tensor(key)
            fan_in, fan_out = shapes[module]
            want = (config.rank, fan_in) if which == "A" else (fan_out, config.rank)
            if tuple(tensor.shape) != want:
                raise refuse(f"tensor {key!r} has shape {tuple(tensor.shape)}, the model "
                             f"needs {want}")
            if which == "A":
                weights.a[(layer, module)] = tensor
            else:
                weights.b[(layer, module)] = tensor.float() * config.scaling
    unpaired = set(weights.a) ^ set(weights.b)
    if unpaired:
        raise refuse(f"lora_A and lora_B do not pair up for {sorted(unpaired)[:4]}")
    if not weights.a:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    return weights
