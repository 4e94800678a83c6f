"""The adapters' device memory: S slots of stacked A and B per layer and projection, the
step's row grouping, and the hooks that add LoRA to the model's projections.

Buffers are allocated once (before CUDA graphs are captured) and only ever written in place:
a slot's weights when an adapter moves into it, the grouping at every step. Writes are queued
on the device's stream behind the steps already queued, so a step in flight reads the slot as
it was when the step was queued.
"""

from __future__ import annotations

import torch

from meshserve.kernels.lora import LoraBatch, add_lora, group_rows
from meshserve.services.worker.lora.weights import LoraWeights, module_shapes
from meshserve.services.worker.models.config import ModelConfig

# The model's fused projections and the adapter modules whose outputs they concatenate.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoraProjection:
    """The hook on one projection of one layer: y [T, N] += LoRA(x [T, K]) per row's slot."""

    def __init__(self, stack: LoraStack, layer: int, projection: str) -> None:
        self.a = stack.a[layer][projection]  # [S, n*R, K]
        self.b = stack.b[layer][projection]  # [S, N, R]
        self.slices = stack.slices[projection]
        self.batch = stack.batch
        self.stack = stack

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.stack.active:  # (decided on the host: eager runs and graph captures)
            add_lora(y, x, self.a, self.b, self.slices, self.batch)


class LoraStack:
    """Static device buffers of `num_slots` adapters of rank up to `rank`."""

    def __init__(self, config: ModelConfig, *, num_slots: int, rank: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.rank, self.device = num_slots, rank, device
        shapes = module_shapes(config)
        self.slices = {p: tuple(shapes[m][1] for m in mods) for p, mods in PROJECTIONS.items()}
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(config.num_hidden_layers):
            self.a.append({p: torch.zeros(num_slots, len(mods) * rank, shapes[mods[0]][0],
                                          dtype=dtype, device=device)
                           for p, mods in PROJECTIONS.items()})
            self.b.append({p: torch.zeros(num_slots, sum(self.slices[p]), rank, dtype=dtype,
                                          device=device) for p in PROJECTIONS})
        # Whether the hooks launch their kernels: a step with no adapter row skips them
        # (`set_step`), and decode CUDA graphs are captured both ways (cuda_graphs.py).
        self.active = True
        self.batch = LoraBatch(
            sorted_rows=torch.zeros(max_tokens, dtype=torch.int32, device=device),
            slot_start=torch.zeros(num_slots, dtype=torch.int32, device=device),
            slot_count=torch.zeros(num_slots, dtype=torch.int32, device=device))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for layer in (*self.a, *self.b) for t in layer.values())

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every adaptable projection of a Llama-family `CausalLM`."""
        for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr,arg-type]
            layer.self_attn.qkv_proj.lora = LoraProjection(self, i, "qkv_proj")
            layer.self_attn.o_proj.lora = LoraProjection(self, i, "o_proj")
            layer.mlp.gate_up_proj.lora = LoraProjection(self, i, "gate_up_proj")
            layer.mlp.down_proj.lora = LoraProjection(self, i, "down_proj")

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Put an adapter into `slot` (zero-padded to the slot rank; absent modules zero)."""
        r = weights.config.rank
        assert r <= self.rank, f"adapter rank {r} above the slot rank {self.rank}"
        for layer, (a_layer, b_layer) in enumerate(zip(self.a, self.b, strict=True)):
            for projection, modules in PROJECTIONS.items():
                a, b = a_layer[projection][slot], b_layer[projection][slot]  # [nR, K], [N, R]
                a.zero_()
                b.zero_()
                offset = 0
                for i, (module, size) in enumerate(zip(modules, self.slices[projection],
                                                       strict=True)):
                    key = (layer, module)
                    if key in weights.a:
                        a[i * self.rank:i * self.rank + r].copy_(weights.a[key],
                                                                 non_blocking=True)
                        b[offset:offset + size, :r].copy_(weights.b[key], non_blocking=True)
                    offset += size

    def set_step(self, row_slots: list[int]) -> None:
        """Group this step's rows by slot (-1: no adapter) into the batch buffers; the
        hooks run only if some row has an adapter. (The buffers are written either way:
        piecewise graphs hold the kernels, which then add nothing.)"""
        self.active = any(slot >= 0 for slot in row_slots)
        assert len(row_slots) <= self.batch.sorted_rows.shape[0], (
            f"a step of {len(row_slots)} rows, buffers for {self.batch.sorted_rows.shape[0]}")
        rows, starts, counts = group_rows(row_slots, self.num_slots)
        meta = torch.tensor(starts + counts + rows, dtype=torch.int32)
        if self.device.type == "cuda":
            meta = meta.pin_memory().to(self.device, non_blocking=True)
        s = self.num_slots
        self.batch.slot_start.copy_(meta[:s], non_blocking=True)
        self.batch.slot_count.copy_(meta[s:2 * s], non_blocking=True)
        self.batch.sorted_rows[:len(rows)].copy_(meta[2 * s:], non_blocking=True)
