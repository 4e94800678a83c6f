"""vLLM's /score, /rerank and /pooling through the whole mesh (`meshserve up --runner
pooling`), driven by the real `openai` client's `post`, checked against transformers'
embeddings on the same tiny random weights.

Real processes (tokenizer, scheduler, a pooling worker, gateway), a real embedded Redis,
real gRPC and HTTP on loopback. An embedding model scores a pair by the cosine similarity
of its two embeddings (the decoder's last-token state, normalised), as vLLM does.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from pooling_stack import pooling_stack, root_client
from tiny_models import build_tiny_model
from transformers import AutoModel, AutoTokenizer

MODEL = "tiny-embed"
MAX_LEN = 48
TOLERANCE = 1e-4
QUERY = "the quick brown fox"
DOCS = ["hello", "a quick brown dog jumps", "seven eleven hundred paper", "the quick brown fox"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("score-model"), "qwen3", seed=5)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with pooling_stack(model_dir, MODEL, tmp_path_factory.mktemp("run"), MAX_LEN) as running:
        yield running


@pytest.fixture(scope="module")
def root(stack) -> openai.OpenAI:
    """The client at the gateway's root: vLLM serves /score, /rerank, /pooling there."""
    return root_client(stack)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def embed(model_dir: Path, tokenizer):
    """transformers' last-token vector of a text, normalised unless `normalize` is False."""
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def vector(text: str, normalize: bool = True) -> torch.Tensor:
        with torch.no_grad():
            last = hf(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1]
        return F.normalize(last, dim=-1) if normalize else last

    return vector


def _post(client: openai.OpenAI, path: str, **body: Any) -> dict[str, Any]:
    return client.post(path, cast_to=object, body={"model": MODEL, **body})  # type: ignore


def _cosine(embed, a: str, b: str) -> float:
    return float(F.cosine_similarity(embed(a), embed(b), dim=0))


def _refused(client: openai.OpenAI, path: str, **body: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        _post(client, path, **body)
    return refused.value.body  # type: ignore[return-value]


def test_score_is_the_cosine_of_the_two_embeddings(root, embed, tokenizer) -> None:
    body = _post(root, "/score", text_1=QUERY, text_2=DOCS)
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert body["model"] == MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(4)]
    expected = [_cosine(embed, QUERY, doc) for doc in DOCS]
    assert np.allclose([d["score"] for d in body["data"]], expected, atol=TOLERANCE, rtol=0)
    assert body["data"][3]["score"] == pytest.approx(1.0, abs=TOLERANCE)  # the same text
    # vLLM's count: each pair's two inputs and the pad token between them.
    lengths = [len(tokenizer(t)["input_ids"]) for t in DOCS]
    query_len = len(tokenizer(QUERY)["input_ids"])
    tokens = sum(query_len + 1 + n for n in lengths)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                             "completion_tokens": 0, "prompt_tokens_details": None}


def test_every_pairing_and_field_name_vllm_accepts(root, embed) -> None:
    pairs = _post(root, "/v1/score", queries=DOCS[:2], documents=DOCS[2:])
    expected = [_cosine(embed, DOCS[0], DOCS[2]), _cosine(embed, DOCS[1], DOCS[3])]
    assert np.allclose([d["score"] for d in pairs["data"]], expected, atol=TOLERANCE, rtol=0)
    one = _post(root, "/score", data_1=DOCS[1], data_2=DOCS[2])
    assert one["data"][0]["score"] == pytest.approx(_cosine(embed, DOCS[1], DOCS[2]),
                                                    abs=TOLERANCE)
    items = _post(root, "/score", queries=[QUERY], items=DOCS[:2])
    assert len(items["data"]) == 2


def test_rerank_orders_the_documents_best_first_and_keeps_top_n(root, embed) -> None:
    scores = [_cosine(embed, QUERY, doc) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    body = _post(root, "/rerank", query=QUERY, documents=DOCS)
    assert set(body) == {"id", "model", "usage", "results"} and body["id"].startswith("rerank-")
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["document"] == {"text": DOCS[result["index"]], "multi_modal": None}
        assert result["relevance_score"] == pytest.approx(scores[result["index"]],
                                                          abs=TOLERANCE)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    for path in ("/v1/rerank", "/v2/rerank"):
        top = _post(root, path, query=QUERY, documents=DOCS, top_n=2)
        assert [r["index"] for r in top["results"]] == order[:2]
        assert top["usage"] == body["usage"]  # every document was scored


def test_pooling_answers_each_inputs_pooled_vector(root, embed) -> None:
    body = _post(root, "/pooling", input=DOCS[:2])
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    for item, text in zip(body["data"], DOCS[:2], strict=True):
        assert np.allclose(item["data"], embed(text).numpy(), atol=TOLERANCE, rtol=0)
    raw = _post(root, "/pooling", input=DOCS[2], use_activation=False, task="embed")
    assert np.allclose(raw["data"][0]["data"], embed(DOCS[2], normalize=False).numpy(),
                       atol=TOLERANCE, rtol=0)
    packed = _post(root, "/pooling", input=DOCS[2], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    assert np.allclose(decoded, embed(DOCS[2]).numpy(), atol=TOLERANCE, rtol=0)


def test_bad_requests_are_refused_in_vllms_words(root) -> None:
    mismatched = _refused(root, "/score", text_1=DOCS[:2], text_2=DOCS[:3])
    assert "Input lengths must be either 1:1, 1:N or N:N" in mismatched["message"]
    empty = _refused(root, "/score", text_1=QUERY, text_2=[])
    assert "At least one text_pair element must be given" in empty["message"]
    assert empty["param"] == "text_2"
    long = " ".join(["word"] * (MAX_LEN * 2))
    too_long = _refused(root, "/score", text_1=long, text_2=QUERY)
    assert "maximum context length is 48 tokens" in too_long["message"]
    assert "in the input for score" in too_long["message"]
    no_docs = _refused(root, "/rerank", query=QUERY)
    assert no_docs["param"] == "documents"
    assert "dimensions is currently not supported" in _refused(
        root, "/pooling", input=QUERY, dimensions=8)["message"]
    assert "Unsupported task: 'classify'" in _refused(root, "/pooling", input=QUERY,
                                                       task="classify")["message"]
    assert _refused(root, "/classify", input=QUERY)["message"] == (
        "The model does not support Classification API")  # an embedding model
    with pytest.raises(openai.NotFoundError):
        root.post("/score", cast_to=object,
                  body={"model": "no-such-model", "text_1": QUERY, "text_2": QUERY})


def test_invocations_answer_score_rerank_and_embedding_bodies(root) -> None:
    score = _post(root, "/invocations", text_1=QUERY, text_2=DOCS[:2])
    assert score["id"].startswith("score-") and len(score["data"]) == 2
    assert score["data"] == _post(root, "/score", text_1=QUERY, text_2=DOCS[:2])["data"]
    rerank = _post(root, "/invocations", query=QUERY, documents=DOCS, top_n=1)
    assert rerank["id"].startswith("rerank-") and len(rerank["results"]) == 1
    embedded = _post(root, "/invocations", input=QUERY)
    assert embedded["data"][0]["object"] == "embedding"
