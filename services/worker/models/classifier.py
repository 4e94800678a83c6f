"""A Llama-family decoder with a sequence-classification head (`*ForSequenceClassification`:
Llama, Mistral, Qwen2, Qwen3), run by a pooling worker.

transformers' model is the causal LM's decoder and a `score` projection without bias,
hidden size -> one logit per label, read at each input's last token. The decoder here is
the embedder's (`DecoderEmbedder`, the same layers and checkpoint names); the head is
applied to the pooled last-token states only, which gives the same logits. The labels are
config.json's `id2label` in class order (transformers writes `LABEL_i` when none is named).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.embedding import DecoderEmbedder
from meshserve.shared.errors import ModelLoadError

# Sequence-classification architecture -> the causal LM whose decoder it runs.
SEQUENCE_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
_HEAD = "score.weight"


def class_labels(hf_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The labels of a sequence classifier's classes, in class order; () for any other
    architecture."""
    architectures = hf_config.get("architectures") or []
    if not architectures or architectures[0] not in SEQUENCE_CLASSIFIERS:
        return ()
    id2label = {str(k): str(v) for k, v in (hf_config.get("id2label") or {}).items()}
    count = len(id2label) or int(hf_config.get("num_labels") or 2)  # transformers' default
    if set(id2label) - {str(i) for i in range(count)}:
        raise ModelLoadError(f"config.json: id2label keys must be the class indices 0.."
                             f"{count - 1}, got {sorted(id2label)}", param="id2label")
    return tuple(id2label.get(str(i), f"LABEL_{i}") for i in range(count))


def decoder_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config of the classifier's decoder: the causal LM's architecture."""
    return {**hf_config, "architectures": [SEQUENCE_CLASSIFIERS[hf_config["architectures"][0]]]}


def sequence_classifier(num_labels: int) -> type[SequenceClassifier]:
    """The model class of a classifier with `num_labels` classes (what the loader builds)."""

    class _Labelled(SequenceClassifier):
        NUM_LABELS = num_labels

    return _Labelled


class SequenceClassifier(DecoderEmbedder):
    """The decoder and its `score` head; forward gives [T, H] normed hidden states, as the
    embedder's, and `classify` turns pooled states into logits."""

    NUM_LABELS = 0

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert self.NUM_LABELS > 0, "build through sequence_classifier(num_labels)"
        self.score = nn.Linear(config.hidden_size, self.NUM_LABELS, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] pooled last-token states -> [B, num_labels] float32 logits."""
        weight = self.score.weight
        return self.score(pooled.to(weight.dtype)).float()

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The embedder's renaming; the head keeps its own name."""
        for name, tensor in weights:
            if name == _HEAD:
                yield name, tensor
            else:
                yield from super()._renamed(((name, tensor),))
