"""/classify through the whole mesh (`meshserve up --runner pooling`) with a tiny random
three-class Llama sequence classifier, driven by the real `openai` client's `post`, checked
against transformers' AutoModelForSequenceClassification on the same weights: softmax
probabilities, the id2label of the best class, raw logits with `use_activation: false`.
Real processes, a real embedded Redis, real gRPC and HTTP on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from pooling_stack import pooling_stack, root_client
from tiny_models import build_tiny_classifier
from transformers import AutoModelForSequenceClassification, AutoTokenizer

MODEL = "tiny-classifier"
LABELS = ["negative", "positive", "neutral"]
TOLERANCE = 1e-4
TEXTS = ["hello", "a quick brown dog jumps", "seven eleven hundred paper music"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("classifier"), "llama",
                                 labels=LABELS, seed=17)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with pooling_stack(model_dir, MODEL, tmp_path_factory.mktemp("run"), 64) as running:
        yield running


@pytest.fixture(scope="module")
def root(stack) -> openai.OpenAI:
    return root_client(stack)


@pytest.fixture(scope="module")
def logits(model_dir: Path):
    """transformers' class logits of a text (or of token ids)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()

    def of(prompt: str | list[int]) -> torch.Tensor:
        ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]  # [3]

    return of


def _post(client: openai.OpenAI, path: str, **body: Any) -> dict[str, Any]:
    return client.post(path, cast_to=object, body={"model": MODEL, **body})  # type: ignore


def test_classify_gives_transformers_probabilities_and_labels(root, logits) -> None:
    body = _post(root, "/classify", input=TEXTS)
    assert body["object"] == "list" and body["model"] == MODEL
    for index, (item, text) in enumerate(zip(body["data"], TEXTS, strict=True)):
        probs = torch.softmax(logits(text), dim=-1)
        assert item["index"] == index and item["num_classes"] == 3
        assert item["probs"] == pytest.approx(probs.tolist(), abs=TOLERANCE)
        assert item["label"] == LABELS[int(probs.argmax())]
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0


def test_raw_logits_and_token_id_inputs(root, logits) -> None:
    raw = _post(root, "/classify", input=TEXTS[1], use_activation=False)
    assert raw["data"][0]["probs"] == pytest.approx(logits(TEXTS[1]).tolist(), abs=TOLERANCE)
    ids = _post(root, "/classify", input=[[7, 8, 9, 10], [300]])
    for item, prompt in zip(ids["data"], [[7, 8, 9, 10], [300]], strict=True):
        expected = torch.softmax(logits(prompt), dim=-1)
        assert item["probs"] == pytest.approx(expected.tolist(), abs=TOLERANCE)
    assert ids["usage"]["prompt_tokens"] == 5


def test_a_many_class_model_does_not_score_pairs(root) -> None:
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})):
        with pytest.raises(openai.BadRequestError) as refused:
            _post(root, path, **body)
        assert "The model does not support" in str(refused.value)
