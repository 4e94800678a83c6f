"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

They are the Llama-family decoder of llama.py (attention, norms, residual stream and paged KV
cache unchanged) with the MLP of some layers replaced by a sparse block:

    router    logits [T, E] = x [T, H] @ gate [E, H]^T; softmax, top k (renormalised or not)
    experts   sum over the k chosen experts e of weight * down_e(silu(gate_e(x)) * up_e(x))
    shared    Qwen2-MoE only: + sigmoid(x @ shared_expert_gate^T) * shared_expert(x)

Qwen2-MoE and Qwen3-MoE keep dense MLP layers (intermediate_size) where `mlp_only_layers` or
`decoder_sparse_step` say so (`ModelConfig.is_sparse_layer`); Mixtral's layers are all sparse,
always top-2 renormalised. Each layer's experts are stacked into two parameters, w13
[E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], run by `meshserve.kernels.moe`.

Checkpoints name the experts one by one (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`, as transformers' `save_pretrained` writes them) or
stacked as transformers holds them in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); `load_weights` takes either.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from meshserve.kernels.linear import linear
from meshserve.kernels.moe import fused_experts, route
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import MLP, CausalLM

# A stacked expert tensor as transformers holds it: (layer prefix, block name, which).
_STACKED = re.compile(r"^(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\."
                      r"(gate_up_proj|down_proj)$")
# transformers' in-memory name of a router (Mixtral's checkpoints say block_sparse_moe).
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")


class ExpertRouter(nn.Module):
    """A bias-free projection to a few logits (the router's [E, H], the shared expert's gate
    [1, H]). Not an nn.Linear on purpose: FP8 quantization (models/quant_fp8.py) replaces
    every nn.Linear of the decoder, and routing decisions stay in the model's dtype."""

    def __init__(self, outputs: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)  # [T, H] -> [T, outputs]


class Experts(nn.Module):
    """E experts' stacked weights: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I].

    Tensor parallelism gives each rank a slice of every expert (smaller I) or, under expert
    parallelism, a subclass holding some experts whole (services/worker/parallel/experts.py)."""

    # With FP8 weights (`--quantization fp8`, models/quant_fp8.py `quantize_experts`): float32
    # scales per expert and output row, w13_scale [E, 2I] and w2_scale [E, H].
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> [T, H]."""
        return fused_experts(x, self.w13, self.w2, weights, expert_ids,
                             w13_scale=self.w13_scale, w2_scale=self.w2_scale)


class SparseMoeBlock(nn.Module):
    """The sparse MLP of one layer: routed experts, plus Qwen2-MoE's gated shared expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = ExpertRouter(config.num_experts, config.hidden_size)
        self.experts = Experts(config.num_experts, config.hidden_size,
                               config.moe_intermediate_size)
        shared = config.shared_expert_intermediate_size
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: ExpertRouter | None = None
        if shared:
            self.shared_expert = MLP(dataclasses.replace(config, intermediate_size=shared))
            self.shared_expert_gate = ExpertRouter(1, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k]
        out = self.experts(x, weights, expert_ids)  # [T, H]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return out


def moe_mlp(config: ModelConfig, index: int) -> nn.Module:
    """Layer `index`'s MLP: the sparse block, or the dense one where the config keeps it."""
    return SparseMoeBlock(config) if config.is_sparse_layer(index) else MLP(config)


class MoeCausalLM(CausalLM):
    """A Llama-family decoder whose sparse layers run experts (see the module docstring)."""

    # How checkpoints name a sparse layer's block and its experts' gate, up and down.
    CHECKPOINT_BLOCK = "mlp"
    EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, mlp_factory=moe_mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As CausalLM's, stacked expert tensors being taken apart into the experts'."""
        super().load_weights(self._unstack(weights))

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """CausalLM's layout with each sparse layer's block under its checkpoint name, its
        experts one by one, and its shared expert's gate/up rows at their own size."""
        layout: dict[str, tuple[str, int, int]] = {}
        for name, target in super().checkpoint_layout().items():
            block = self._sparse_block_of(name)
            if block is None:
                layout[name] = target
            elif ".experts." not in name:  # router, shared expert and its gate
                layout[name.replace(".mlp.", f".{self.CHECKPOINT_BLOCK}.", 1)] = target
        for index, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                layout.update(self._expert_layout(index, layer.mlp))
        return layout

    def _sparse_block_of(self, name: str) -> SparseMoeBlock | None:
        match = re.match(r"model\.layers\.(\d+)\.mlp\.", name)
        if match is None:
            return None
        block = self.model.layers[int(match[1])].mlp
        return block if isinstance(block, SparseMoeBlock) else None

    def _expert_layout(self, index: int,
                       block: SparseMoeBlock) -> dict[str, tuple[str, int, int]]:
        """Checkpoint names of layer `index`'s experts and shared expert -> rows of ours.

        Expert rows count over the stacked parameter flattened to 2D ([E*2I, H], [E*H, I]),
        as `CausalLM.load_weights` narrows a 3D parameter."""
        num_experts, two_inter, hidden = block.experts.w13.shape
        inter = two_inter // 2
        ours = f"model.layers.{index}.mlp.experts"
        theirs = f"model.layers.{index}.{self.CHECKPOINT_BLOCK}.experts"
        gate, up, down = self.EXPERT_NAMES
        layout: dict[str, tuple[str, int, int]] = {}
        for e in range(num_experts):
            layout[f"{theirs}.{e}.{gate}.weight"] = (f"{ours}.w13", e * two_inter, inter)
            layout[f"{theirs}.{e}.{up}.weight"] = (f"{ours}.w13", e * two_inter + inter, inter)
            layout[f"{theirs}.{e}.{down}.weight"] = (f"{ours}.w2", e * hidden, hidden)
        if block.shared_expert is not None:
            shared = block.shared_expert.down_proj.in_features
            fused = f"model.layers.{index}.mlp.shared_expert.gate_up_proj.weight"
            prefix = f"model.layers.{index}.{self.CHECKPOINT_BLOCK}.shared_expert"
            layout[f"{prefix}.gate_proj.weight"] = (fused, 0, shared)
            layout[f"{prefix}.up_proj.weight"] = (fused, shared, shared)
        return layout

    def _unstack(self, weights: Iterable[tuple[str, torch.Tensor]],
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stacked expert tensors -> one tensor per expert, and routers, under the
        checkpoint's names."""
        gate, up, down = self.EXPERT_NAMES
        for name, tensor in weights:
            match = _STACKED.match(name)
            if match is None or tensor.dim() != 3:
                router = _ROUTER.match(name)
                yield (name if router is None
                       else f"{router[1]}.{self.CHECKPOINT_BLOCK}.gate.weight"), tensor
                continue
            prefix = f"{match[1]}.{self.CHECKPOINT_BLOCK}.experts"
            if match[3] == "down_proj":  # [E, H, I]
                for e in range(tensor.shape[0]):
                    yield f"{prefix}.{e}.{down}.weight", tensor[e]
                continue
            inter = tensor.shape[1] // 2  # [E, 2I, H]: gate rows, then up rows
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.{gate}.weight", tensor[e, :inter]
                yield f"{prefix}.{e}.{up}.weight", tensor[e, inter:]


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B): qk-norm attention, top-k routing (`norm_topk_prob`),
    dense layers where `mlp_only_layers` / `decoder_sparse_step` keep them."""


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE / Qwen1.5-MoE: q/k/v bias, a sigmoid-gated shared expert in every sparse
    layer, top-k weights not renormalised unless `norm_topk_prob`."""


class MixtralForCausalLM(MoeCausalLM):
    """Mixtral: Mistral attention, every layer sparse, top-2 renormalised; checkpoints name the
    block `block_sparse_moe` and its experts' gate/up/down w1/w3/w2."""

    CHECKPOINT_BLOCK = "block_sparse_moe"
    EXPERT_NAMES = ("w1", "w3", "w2")
