"""/v1/embeddings through the whole mesh (`meshserve up --runner pooling`), driven by the
real `openai` client, checked against transformers on the same tiny random weights.

Real processes (tokenizer, scheduler, two pooling workers, gateway), a real embedded
Redis, real gRPC and HTTP on loopback. The model is a tiny Qwen3 whose config allows the
Matryoshka lengths 16, 32 and 64 (its hidden size).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from tiny_models import build_tiny_model
from transformers import AutoModel, AutoTokenizer

from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-embed"
MAX_LEN = 48
TOLERANCE = 1e-4
TEXTS = ["the quick brown fox", "hello", "seven eleven hundred paper music night sky river"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("embed-model"), "qwen3", seed=3,
                            matryoshka_dimensions=[16, 32, 64])


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # A token budget of one context: long inputs of one request take separate forwards.
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, runner="pooling",
                            workers=2, port=0, dtype="float32", device="cpu", kvstore=False,
                            max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    """Last-token vectors of transformers' decoder, first `dims` dimensions, normalised."""
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def embed(ids: list[int], dims: int = 64) -> np.ndarray:
        with torch.no_grad():
            last = hf(torch.tensor([ids])).last_hidden_state[0, -1, :dims]
        return F.normalize(last, dim=-1).numpy()

    return embed


def _close(got: list[float], expected: np.ndarray) -> bool:
    return bool(np.allclose(np.asarray(got, dtype=np.float32), expected, atol=TOLERANCE, rtol=0))


def test_strings_embed_as_transformers_does(client, tokenizer, reference) -> None:
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert [d.index for d in out.data] == [0, 1, 2]
    for item, token_ids in zip(out.data, ids, strict=True):
        assert len(item.embedding) == 64
        assert _close(item.embedding, reference(token_ids))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    assert out.model == MODEL
    single = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert len(single.data) == 1 and _close(single.data[0].embedding, reference(ids[1]))


def test_token_ids_embed_as_they_are(client, reference) -> None:
    one = client.embeddings.create(model=MODEL, input=[5, 6, 7, 8], encoding_format="float")
    assert _close(one.data[0].embedding, reference([5, 6, 7, 8]))
    many = client.embeddings.create(model=MODEL, input=[[9], [10, 11, 12]],
                                    encoding_format="float")
    assert _close(many.data[0].embedding, reference([9]))
    assert _close(many.data[1].embedding, reference([10, 11, 12]))
    assert many.usage.prompt_tokens == 4


def test_base64_decodes_to_the_float_vectors(client) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    encoded = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for f, e in zip(floats.data, encoded.data, strict=True):
        assert isinstance(e.embedding, str)
        decoded = np.frombuffer(base64.b64decode(e.embedding), dtype="<f4")
        assert decoded.tolist() == f.embedding  # the same float32 values, bit for bit
    # The client's default (base64 on the wire, decoded by the client) agrees too.
    default = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert np.allclose(default.data[0].embedding, floats.data[0].embedding, atol=0, rtol=0)


def test_dimensions_are_allowed_only_where_the_model_allows(client, tokenizer,
                                                            reference) -> None:
    ids = tokenizer(TEXTS[0])["input_ids"]
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=32,
                                     encoding_format="float")
    assert len(short.data[0].embedding) == 32
    assert _close(short.data[0].embedding, reference(ids, 32))  # truncated, then normalised
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=48)
    assert refused.value.body["param"] == "dimensions"  # type: ignore[index]


def test_too_long_inputs_are_refused_and_truncation_keeps_the_last_tokens(client,
                                                                          reference) -> None:
    long = list(range(1, MAX_LEN + 6))
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[long])
    assert "maximum context length is 48 tokens" in str(refused.value)
    kept = client.embeddings.create(model=MODEL, input=[long], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 10})
    assert kept.usage.prompt_tokens == 10
    assert _close(kept.data[0].embedding, reference(long[-10:]))


def test_generation_on_an_embedding_model_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as completions:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert "embedding model" in str(completions.value)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in str(chat.value)


def test_the_raw_body_is_exactly_openais(stack) -> None:
    request = urllib.request.Request(
        f"{stack.base_url}/embeddings", method="POST",
        data=json.dumps({"model": MODEL, "input": ["a b", "c"]}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = json.loads(response.read())
    assert set(body) == {"object", "data", "model", "usage"} and body["object"] == "list"
    assert [set(d) for d in body["data"]] == [{"object", "index", "embedding"}] * 2
    assert {d["object"] for d in body["data"]} == {"embedding"}
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    bad = urllib.request.Request(
        f"{stack.base_url}/embeddings", method="POST",
        data=json.dumps({"model": MODEL, "input": []}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=60)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["param"] == "input"
