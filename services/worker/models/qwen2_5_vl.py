"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a vision half (shared/vision_models.py:
transformers' window-attention tower and 2x2 patch merger) and Qwen2's language model with
M-RoPE.

The language model is llama.py's with Qwen2's q/k/v biases; only its rotary differs: each
token has three positions (time, height, width) and `rope_scaling.mrope_section` says which
rotary pairs each of them turns (kernels/rotary.py's MropeRotaryEmbedding). Text tokens
share one position; an image's rows take its grid's; text after an image continues from the
largest before it + 1. The engine computes a prompt's positions once at admission from its
images' grids (`image_grid`; engine/mrope.py) and passes positions [3, T] only to steps that
hold image rows; every other step passes the shifted positions [T] of plain RoPE.

Checkpoint layouts: transformers 4 (`model.layers.*`, `visual.*`, `lm_head.*`) and 5
(`model.language_model.*`, `model.visual.*`, `lm_head.*`).
"""

from __future__ import annotations

from meshserve.kernels.rotary import MropeRotaryEmbedding
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llava import VisionLanguageModel
from meshserve.shared.vision_models import Qwen2_5_VLVision


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2.5-VL: images of any size, each its own grid of rows; M-RoPE positions."""

    vision: Qwen2_5_VLVision

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None, "a Qwen2.5-VL config names its vision tower"
        assert config.mrope_section, "Qwen2.5-VL's rope_scaling names its mrope_section"
        self.vision = Qwen2_5_VLVision(config.vision, config.hidden_size,
                                       config.image_processor)
        self.model.rotary_emb = MropeRotaryEmbedding(
            config.head_dim, config.rotary_dim, config.max_position_embeddings,
            config.rope_theta, config.rope_scaling, config.mrope_section)

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(time, height, width) of the rows an image of that size becomes."""
        return self.vision.image_grid(width, height)
