"""A one-label sequence classifier (a cross-encoder) through the whole mesh (`meshserve up
--runner pooling`): /score, /rerank, /classify and /pooling driven by the real `openai`
client's `post`, checked against transformers' AutoModelForSequenceClassification on the
same tiny random weights.

A pair is one input, its two texts' token ids end to end (each tokenized as the tokenizer
does alone, which is what a text pair gives for this byte-level tokenizer); its score is
the logit through a sigmoid, as vLLM scores with a cross-encoder. Real processes, a real
embedded Redis, real gRPC and HTTP on loopback.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from pooling_stack import pooling_stack, root_client
from tiny_models import build_tiny_classifier
from transformers import AutoModelForSequenceClassification, AutoTokenizer

MODEL = "tiny-reranker"
TOLERANCE = 1e-4
QUERY = "the quick brown fox"
DOCS = ["hello", "a quick brown dog jumps", "seven eleven hundred paper", "the quick fox"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("reranker"), "qwen2",
                                 labels=["LABEL_0"], seed=13)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with pooling_stack(model_dir, MODEL, tmp_path_factory.mktemp("run"), 64) as running:
        yield running


@pytest.fixture(scope="module")
def root(stack) -> openai.OpenAI:
    return root_client(stack)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def logit(model_dir: Path, tokenizer):
    """transformers' logit of texts laid end to end as token ids."""
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()

    def of(*texts: str) -> float:
        ids = [t for text in texts for t in tokenizer(text)["input_ids"]]
        with torch.no_grad():
            return float(hf(torch.tensor([ids])).logits[0, 0])

    return of


def _post(client: openai.OpenAI, path: str, **body: Any) -> dict[str, Any]:
    return client.post(path, cast_to=object, body={"model": MODEL, **body})  # type: ignore


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_score_is_the_sigmoid_of_the_pairs_logit(root, logit, tokenizer) -> None:
    body = _post(root, "/score", text_1=QUERY, text_2=DOCS)
    expected = [_sigmoid(logit(QUERY, doc)) for doc in DOCS]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=TOLERANCE)
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    lengths = {text: len(tokenizer(text)["input_ids"]) for text in [QUERY, *DOCS]}
    tokens = sum(lengths[QUERY] + lengths[doc] for doc in DOCS)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    raw = _post(root, "/v1/score", queries=DOCS[:2], documents=DOCS[2:], use_activation=False)
    assert [d["score"] for d in raw["data"]] == pytest.approx(
        [logit(DOCS[0], DOCS[2]), logit(DOCS[1], DOCS[3])], abs=TOLERANCE)
    # The order of a pair matters to a cross-encoder (not to a cosine).
    assert abs(logit(DOCS[0], DOCS[2]) - logit(DOCS[2], DOCS[0])) > 1e-3


def test_rerank_orders_by_the_cross_encoders_scores(root, logit) -> None:
    scores = [_sigmoid(logit(QUERY, doc)) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    body = _post(root, "/v2/rerank", query=QUERY, documents=DOCS, top_n=3)
    assert [r["index"] for r in body["results"]] == order[:3]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [scores[i] for i in order[:3]], abs=TOLERANCE)
    assert body["results"][0]["document"]["text"] == DOCS[order[0]]


def test_classify_and_pooling_answer_the_one_class_probability(root, logit) -> None:
    body = _post(root, "/classify", input=DOCS[:2])
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("classify-")
    for item, doc in zip(body["data"], DOCS[:2], strict=True):
        assert set(item) == {"index", "label", "probs", "num_classes"}
        assert (item["label"], item["num_classes"]) == ("LABEL_0", 1)
        assert item["probs"] == pytest.approx([_sigmoid(logit(doc))], abs=TOLERANCE)
    pooled = _post(root, "/pooling", input=DOCS[0])
    assert pooled["data"][0]["data"] == pytest.approx([_sigmoid(logit(DOCS[0]))],
                                                      abs=TOLERANCE)
    raw = _post(root, "/pooling", input=DOCS[0], task="classify", use_activation=False)
    assert raw["data"][0]["data"] == pytest.approx([logit(DOCS[0])], abs=TOLERANCE)
    invoked = _post(root, "/invocations", input=DOCS[:2])  # a classifier's `input`: /classify
    assert invoked["id"].startswith("classify-")
    assert [d["probs"] for d in invoked["data"]] == [d["probs"] for d in body["data"]]


def test_what_a_classifier_does_not_serve_is_refused(root) -> None:
    with pytest.raises(openai.BadRequestError) as task:
        _post(root, "/pooling", input=QUERY, task="embed")
    assert "Unsupported task: 'embed'" in str(task.value)
    with pytest.raises(openai.BadRequestError) as embed:
        _post(root, "/v1/embeddings", input=QUERY)
    assert "The model does not support Embeddings API" in str(embed.value)
