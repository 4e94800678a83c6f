"""Contract tests of /score, /rerank and /pooling at the gateway, against the fake services
(test_gateway_fakes.py): their workers generate, so every scoring and pooling request is
refused in vLLM's words, and a malformed body is refused before anything is asked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from test_gateway_fakes import MODEL, Mesh, start_mesh


@pytest.fixture
async def root() -> AsyncIterator[tuple[Mesh, AsyncOpenAI]]:
    async with start_mesh() as mesh, AsyncOpenAI(base_url=mesh.base_url, api_key="unused",
                                                 max_retries=0, timeout=20) as client:
        yield mesh, client


async def _refused(client: AsyncOpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.post(path, cast_to=object, body={"model": MODEL, **body})
    return refused.value.body  # type: ignore[return-value]


async def test_a_generation_model_does_not_serve_scoring_or_pooling(root) -> None:
    mesh, client = root
    cases = [("/score", {"text_1": "a", "text_2": "b"}, "Score API"),
             ("/classify", {"input": "a"}, "Classification API"),
             ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}, "Score API"),
             ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank (Score) API"),
             ("/v1/rerank", {"query": "a", "documents": ["b"]}, "Rerank (Score) API"),
             ("/v2/rerank", {"query": "a", "documents": ["b"]}, "Rerank (Score) API"),
             ("/pooling", {"input": "a"}, "Pooling API")]
    for path, body, api in cases:
        error = await _refused(client, path, body)
        assert error["message"] == f"The model does not support {api}", path
        assert error["param"] == "model" and error["type"] == "invalid_request_error"
    assert mesh.scheduler.routes == []  # nothing was routed


async def test_malformed_bodies_are_refused_naming_the_parameter(root) -> None:
    mesh, client = root
    cases = [("/score", {"text_1": "a"}, "text_1"),
             ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
             ("/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
             ("/score", {"text_1": {"content": []}, "text_2": "b"}, "text_1"),
             ("/score", {"text_1": "a", "text_2": ""}, "text_2"),
             ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
             ("/rerank", {"query": "a", "documents": []}, "documents"),
             ("/rerank", {"query": "a", "documents": ["b"], "top_n": "2"}, "top_n"),
             ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
              "truncate_prompt_tokens"),
             ("/pooling", {"input": []}, "input"),
             ("/pooling", {"input": "a", "dimensions": 4}, "dimensions"),
             ("/pooling", {"input": "a", "encoding_format": "bytes"}, "encoding_format"),
             ("/pooling", {"input": "a", "mm_processor_kwargs": {"x": 1}},
              "mm_processor_kwargs")]
    for path, body, param in cases:
        error = await _refused(client, path, body)
        assert error["param"] == param, (path, body, error)
    assert mesh.tokenizer.tokenize_calls == []  # refused before tokenizing
