"""Building a worker's multi-LoRA state: the slots on the device and the `--lora-modules`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.services.worker.lora.manager import LoraManager
from meshserve.services.worker.lora.stack import LoraStack
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.registry import refuse_unsupported
from meshserve.services.worker.parallel.config import ShardPlan
from meshserve.shared.lora_config import LoraModule


def build_lora(model: torch.nn.Module, config: ModelConfig, *, max_loras: int,
               max_lora_rank: int, max_cpu_loras: int | None, max_tokens: int,
               modules: Sequence[LoraModule], dtype: torch.dtype,
               device: torch.device, shard: ShardPlan | None = None) -> LoraManager:
    """Allocate `max_loras` slots of rank `max_lora_rank`, hook them into `model` and load
    `modules` (their errors propagate: a worker does not start with a broken adapter).
    `config` is the whole model's; with tensor parallelism (`shard`) the slots hold this
    rank's part of each adapter."""
    refuse_unsupported(config.architecture, "lora")
    local = config if shard is None else shard.local_config()
    stack = LoraStack(local, num_slots=max_loras, rank=max_lora_rank, max_tokens=max_tokens,
                      dtype=dtype, device=device)
    stack.attach(model)
    manager = LoraManager(config, stack, max_cpu_loras=max(max_cpu_loras or max_loras,
                                                           max_loras), shard=shard)
    for module in modules:
        manager.add(module)
    return manager
