"""LLaVA-1.5 (`LlavaForConditionalGeneration`) and LLaVA-NeXT
(`LlavaNextForConditionalGeneration`): a vision half (shared/vision_models.py: the tower and
the projector; LLaVA-NeXT's any-resolution tiles and image_newline) and a Llama-family
language model (Llama, Vicuna, Mistral, Qwen2) over the paged KV cache.

The vision half turns each image into `rows_for` embedding rows; they replace the prompt's
run of image tokens (`CausalLM.forward`'s `image_rows`); the rest is the language model of
llama.py. The encoder service runs the same vision half on its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.shared.vision_models import LlavaNextVision, LlavaVision, VisionPart

# The language model's checkpoint prefixes -> this module's: transformers 4's layout
# (language_model.model.*) and 5's (model.language_model.*).
_TEXT_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


class VisionLanguageModel(CausalLM):
    """A language model of llama.py with a vision half under `self.vision`."""

    vision: VisionPart

    def rows_for(self, width: int, height: int) -> int:
        return self.vision.rows_for(width, height)

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.vision.embed_images(inputs)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        self.vision.reset_buffers()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((self._renamed(name), tensor) for name, tensor in weights)

    def _renamed(self, name: str) -> str:
        own = self.vision.own_name(name)
        if own is not None:
            return "vision." + own
        for old, new in _TEXT_RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA-1.5: images of a fixed square size, each the same number of rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None, "a LLaVA config names its vision tower"
        self.vision = LlavaVision(config.vision, config.hidden_size)


class LlavaNextForConditionalGeneration(VisionLanguageModel):
    """LLaVA-NeXT: images of any size in tiles, each its own number of rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None, "a LLaVA-NeXT config names its vision tower"
        self.vision = LlavaNextVision(config.vision, config.hidden_size)
