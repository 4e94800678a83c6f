"""`suffix` on /v1/completions through the gateway and the real Tokenizer servicer: the
worker is sent the prompt in the model's fill-in-the-middle tokens; a model without them
answers a 400 on `suffix` that says why, carried across the Tokenize RPC."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from openai import AsyncOpenAI, BadRequestError
from test_gateway_fakes import MAX_MODEL_LEN, MODEL, FakeWorker, Mesh, script, start_mesh
from tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import TokenizerServicer

FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))"


def encode(hf: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(hf.encode(text, add_special_tokens=False))


@asynccontextmanager
async def serving(hf: PreTrainedTokenizerFast) -> AsyncIterator[tuple[Mesh, AsyncOpenAI]]:
    """The gateway in front of the real tokenizer servicer of `hf` and a fake worker."""
    served = ServedModel(Tokenizer(hf, name=MODEL), (MODEL,), MAX_MODEL_LEN)
    worker = FakeWorker(encode=lambda text: encode(hf, text),
                        eos=hf.convert_tokens_to_ids("<|endoftext|>"))
    async with start_mesh(tokenizer=TokenizerServicer(served), worker=worker) as mesh, \
            AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0) as api:
        yield mesh, api


async def test_the_worker_gets_prefix_suffix_middle_in_fim_tokens() -> None:
    hf = build_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": FIM})
    begin, after, middle = (hf.convert_tokens_to_ids(t) for t in FIM)
    async with serving(hf) as (mesh, api):
        result = await api.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX,
                                              max_tokens=40)
        assert result.choices[0].text == script(0)
        [request] = mesh.worker.requests
        assert list(request.prompts[0].token_ids) == [
            begin, *encode(hf, PREFIX), after, *encode(hf, SUFFIX), middle]
        assert result.usage is not None
        assert result.usage.prompt_tokens == len(request.prompts[0].token_ids)
        # Token-id prompts cannot be rearranged: refused before anything runs.
        with pytest.raises(BadRequestError) as refused:
            await api.completions.create(model=MODEL, prompt=[1, 2, 3], suffix=SUFFIX)
        assert refused.value.body["param"] == "suffix"  # type: ignore[index]
        assert len(mesh.worker.requests) == 1


async def test_a_model_without_fim_tokens_answers_a_400_saying_why() -> None:
    hf = build_tokenizer()
    async with serving(hf) as (mesh, api):
        with pytest.raises(BadRequestError) as refused:
            await api.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX)
        assert refused.value.body["param"] == "suffix"  # type: ignore[index]
        assert "the model's tokenizer has no fill-in-the-middle tokens" in \
            refused.value.message
        assert mesh.worker.requests == []
        plain = await api.completions.create(model=MODEL, prompt=PREFIX, max_tokens=3)
        # Without a suffix the same model answers.
        assert plain.choices[0].text == hf.decode(encode(hf, script(0))[:3])
