"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a vision tower, a two-layer projector and a
Llama-family language model over the paged KV cache.

An image becomes `num_image_rows` embedding rows: the tower's hidden states at
`vision_feature_layer` (several layers concatenated when it is a list), less the class
embedding with the "default" feature strategy, through the projector. The rows replace the
prompt's run of image tokens (`CausalLM.forward`'s `image_rows`); the rest is the language
model of llama.py. The vision tower is transformers' own module for the tower's config
(CLIP or SigLIP), run once per image, never per decode step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.shared.errors import ModelLoadError

# Checkpoint prefixes -> this module's: transformers 4's layout (language_model.model.*)
# and 5's in-memory one (model.language_model.*, model.vision_tower.*).
_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# transformers 4 wrapped CLIP/SigLIP towers' modules in a `vision_model`; 5 does not.
_TOWER_WRAPPER = "vision_tower.vision_model."


def vision_tower(vision_config: dict[str, Any]) -> nn.Module:
    """transformers' vision model for a `vision_config` dict (CLIP, SigLIP, ...)."""
    settings = dict(vision_config)
    model_type = settings.pop("model_type", "clip_vision_model")
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except ValueError as exc:
        raise ModelLoadError(f"vision tower type {model_type!r} is not known to transformers",
                             param="vision_config") from exc
    return AutoModel.from_config(config)


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2: tower features [N, Dv] -> text embeddings [N, H]."""

    def __init__(self, vision_dim: int, hidden_size: int, activation: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_dim, hidden_size, bias=bias)
        self.act = ACT2FN[activation]
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(CausalLM):
    """LLaVA-1.5: images of a fixed square size, each `num_image_rows` embedding rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None, "a LLaVA config names its vision tower"
        hf = config.vision
        self.vision_tower = vision_tower(hf["vision_config"])
        self.feature_layers: list[int] = (
            list(hf.get("vision_feature_layer", -2))
            if isinstance(hf.get("vision_feature_layer", -2), list)
            else [int(hf.get("vision_feature_layer", -2))])
        self.feature_strategy = str(hf.get("vision_feature_select_strategy", "default"))
        tower: Any = self.vision_tower.config
        self.multi_modal_projector = LlavaProjector(
            int(tower.hidden_size) * len(self.feature_layers), config.hidden_size,
            str(hf.get("projector_hidden_act", "gelu")),
            bool(hf.get("multimodal_projector_bias", True)))
        patches = (int(tower.image_size) // int(tower.patch_size)) ** 2
        self.num_image_rows: int = patches + (1 if self.feature_strategy == "full" else 0)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        # The tower's only buffers are its position ids [1, P] (0..P-1).
        for name, buffer in self.vision_tower.named_buffers():
            assert name.endswith("position_ids"), f"vision tower buffer {name} not rebuilt"
            buffer.copy_(torch.arange(buffer.shape[-1], device=buffer.device).expand_as(buffer))

    def rows_for(self, width: int, height: int) -> int:
        """Embedding rows of an image of that size (every image is resized to the tower's)."""
        return self.num_image_rows

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's output for N images -> each image's rows [rows, H]."""
        pixels = inputs["pixel_values"]  # [N, 3, S, S]
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixels.to(dtype), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        if self.feature_strategy == "default":
            features = features[:, 1:]  # without the class embedding
        return list(self.multi_modal_projector(features))  # N x [rows, H]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_renamed(name), tensor) for name, tensor in weights)


def _renamed(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if name.startswith(_TOWER_WRAPPER):
        name = "vision_tower." + name[len(_TOWER_WRAPPER):]
    return name
