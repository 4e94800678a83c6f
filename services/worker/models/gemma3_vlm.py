"""Gemma 3 with images (`Gemma3ForConditionalGeneration`: gemma-3-4b, 12b, 27b): the vision
half of shared/vision_models.py (SigLIP, pooled to `mm_tokens_per_image` rows, normed and
projected) and Gemma 3's language model of gemma.py over the paged KV cache.

Its logits are not soft-capped, as transformers' Gemma3ForConditionalGeneration leaves them.
Two things set its images apart from LLaVA's, both as transformers runs them:
- an image's rows replace its placeholders' embeddings unscaled, while every text token's is
  scaled by sqrt(hidden_size) (`GemmaModel.embed`, before `DecoderModel.forward` puts the
  rows in);
- during prefill an image's rows attend to every row of their image, not only the ones
  before (transformers' token_type_ids mask; decode stays causal). `bidirectional_images`
  has the scheduler compute each image's rows in one step (step_scheduler.py's
  whole_images) and the runner pass each row how far it reads ahead
  (`AttentionMetadata.lookahead`), which the reference and the Triton kernel honour,
  sliding-window layers included.

A prefix-cache hit may end inside an image: its blocks' hashes hold the image's digest and
place, and they were computed with the whole image in their step, so their KV is what a
fresh prefill makes; the rest of the image is then computed reading those rows back.
"""

from __future__ import annotations

import torch

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.gemma import Gemma3ForCausalLM
from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.models.llava import VisionLanguageModel
from meshserve.shared.vision_models import Gemma3Vision


class Gemma3ForConditionalGeneration(VisionLanguageModel, Gemma3ForCausalLM):
    """Gemma 3's language model (gemma.py) with the vision half under `self.vision`
    (llava.py's VisionLanguageModel: rows_for, embed_images, the checkpoint's prefixes)."""

    bidirectional_images = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None, "a Gemma 3 config names its vision tower"
        self.vision = Gemma3Vision(config.vision, config.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """CausalLM's logits, without gemma.py's final soft-capping: transformers'
        Gemma3ForConditionalGeneration never applies final_logit_softcapping (only its text
        model does; the published checkpoints set none)."""
        return CausalLM.compute_logits(self, hidden)
