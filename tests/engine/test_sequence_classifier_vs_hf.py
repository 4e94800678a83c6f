"""A pooling worker's sequence classifier against transformers' AutoModelForSequenceClassification
on the same tiny random weights.

transformers reads the `score` head at each input's last (non-pad) token; ours runs every
input of a batch in one flat forward through the engine's attention path and applies the
head to the pooled last-token states. Inputs hold no pad token (id 0), so "last non-pad"
is the last token. Float32, within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_classifier
from transformers import AutoModelForSequenceClassification

from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.models.classifier import class_labels
from meshserve.services.worker.pooling.embedder import Embedder
from meshserve.services.worker.pooling.pooler import finish
from meshserve.shared.errors import ModelLoadError

# Different lengths, one of a single token, one past a 16-token block; no pad token (0).
INPUTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(100, 133)), [40, 41, 42, 43]]
TOLERANCE = 1e-4
LABELS = ["negative", "positive", "neutral"]


def _reference(model_dir: Path, inputs: list[list[int]]) -> torch.Tensor:
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([ids])).logits for ids in inputs])  # [B, labels]


def _classifier(model_dir: Path) -> Embedder:
    return Embedder(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_a_batch_of_logits_equals_transformers(tmp_path: Path, arch: str) -> None:
    model_dir = build_tiny_classifier(tmp_path / arch, arch, labels=LABELS, seed=7)
    classifier = _classifier(model_dir)
    assert classifier.class_labels == tuple(LABELS)
    assert classifier.hidden_size == 3  # what the worker announces as its vector length
    assert classifier.pooler.pooling_type == "LAST" and not classifier.pooler.normalize
    ours = classifier.embed(INPUTS)  # one forward
    expected = _reference(model_dir, INPUTS)
    assert ours.shape == expected.shape == (len(INPUTS), 3)
    assert torch.allclose(ours, expected, atol=TOLERANCE, rtol=0), (
        (ours - expected).abs().max().item())
    assert not torch.allclose(ours[0], ours[3], atol=1e-2)  # the logits differ per input
    # What the worker sends back: the logits as they are (no normalisation).
    assert torch.equal(finish(ours, 3, classifier.pooler.normalize), ours)


def test_a_one_label_cross_encoder_gives_transformers_logit(tmp_path: Path) -> None:
    model_dir = build_tiny_classifier(tmp_path / "ce", "qwen2", labels=["LABEL_0"], seed=11)
    classifier = _classifier(model_dir)
    ours = classifier.embed(INPUTS)
    expected = _reference(model_dir, INPUTS)
    assert ours.shape == (len(INPUTS), 1)
    assert torch.allclose(ours, expected, atol=TOLERANCE, rtol=0)
    # The same input alone and inside a batch: the same logit.
    alone = classifier.embed([INPUTS[2]])
    assert torch.allclose(alone[0], ours[2], atol=TOLERANCE, rtol=0)


def test_labels_come_from_id2label_in_class_order() -> None:
    config = {"architectures": ["LlamaForSequenceClassification"],
              "id2label": {"1": "b", "0": "a"}}
    assert class_labels(config) == ("a", "b")
    assert class_labels({"architectures": ["Qwen2ForSequenceClassification"],
                         "num_labels": 3}) == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert class_labels({"architectures": ["Qwen2ForCausalLM"]}) == ()
    with pytest.raises(ModelLoadError):
        class_labels({"architectures": ["Qwen2ForSequenceClassification"],
                      "id2label": {"0": "a", "5": "b"}})
