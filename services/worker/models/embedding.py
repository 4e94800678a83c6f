"""A Llama-family decoder run as an embedder (vLLM's `--convert embed`).

The same layers as `CausalLM`, without the output projection: a pooling worker only
reads the final hidden states. Its checkpoints come in two layouts, both accepted:
the causal LM's (`model.layers.0...`, with an `lm_head.weight` that is skipped) and the
bare decoder's that sentence-transformers saves (Qwen3-Embedding: `layers.0...`,
`embed_tokens.weight`, `norm.weight`), whose names gain the `model.` prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM, DecoderModel

_PREFIX = "model."


class DecoderEmbedder(CausalLM):
    """The decoder stack of a causal LM; forward gives [T, H] normed hidden states."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)  # not CausalLM's: no lm_head to build
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """CausalLM's loading over names in either layout (module doc)."""
        super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name == "lm_head.weight":
                continue  # the output projection: nothing of an embedder's
            yield (name if name.startswith(_PREFIX) else _PREFIX + name), tensor
