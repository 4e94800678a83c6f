"""The gateway with the real Tokenizer servicer (tiny byte-level BPE, ChatML template).

The fake worker streams the tokenizer's own encoding of each `script(i)`; references
come from the Hugging Face tokenizer directly (encode, apply_chat_template, decode).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from openai import AsyncOpenAI, BadRequestError
from test_gateway_fakes import MAX_MODEL_LEN, MODEL, FakeWorker, Mesh, script, start_mesh
from tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import TokenizerServicer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def encode(hf: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(hf.encode(text, add_special_tokens=False))


@pytest.fixture
async def mesh(hf: PreTrainedTokenizerFast) -> AsyncIterator[Mesh]:
    served = ServedModel(Tokenizer(hf, name=MODEL), (MODEL,), MAX_MODEL_LEN)
    worker = FakeWorker(encode=lambda text: encode(hf, text),
                        eos=hf.convert_tokens_to_ids("<|endoftext|>"))
    async with start_mesh(tokenizer=TokenizerServicer(served), worker=worker) as started:
        yield started


@pytest.fixture
async def api(mesh: Mesh) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0) as c:
        yield c


async def test_chat_stream_n2_matches_the_tokenizer(mesh: Mesh, api: AsyncOpenAI,
                                                    hf: PreTrainedTokenizerFast) -> None:
    stream = await api.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True,
                                               stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    for i in (0, 1):
        ids = encode(hf, script(i))
        assert hf.decode(ids) == script(i)  # the reference round-trips
        assert texts[i] == script(i)  # EOS is a special token: not in the text
    assert finish == {0: "stop", 1: "stop"}
    prompt_ids = list(hf.apply_chat_template(MESSAGES, tokenize=True,
                                             add_generation_prompt=True)["input_ids"])
    assert list(mesh.worker.requests[0].prompts[0].token_ids) == prompt_ids
    assert usage is not None and usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == sum(len(encode(hf, script(i))) + 1 for i in (0, 1))


async def test_stop_string_counts_tokens_up_to_the_stop(mesh: Mesh, api: AsyncOpenAI,
                                                        hf: PreTrainedTokenizerFast) -> None:
    result = await api.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["wör"])
    choice = result.choices[0]
    assert choice.message.content == script(0)[:script(0).find("wör")]
    assert choice.finish_reason == "stop"
    ids = encode(hf, script(0))
    needed = next(k for k in range(1, len(ids) + 1) if "wör" in hf.decode(ids[:k]))
    assert result.usage is not None and result.usage.completion_tokens == needed


async def test_logprob_tokens_carry_the_tokens_bytes(mesh: Mesh, api: AsyncOpenAI,
                                                     hf: PreTrainedTokenizerFast) -> None:
    ids = encode(hf, script(0))
    result = await api.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                               max_tokens=len(ids))
    content = result.choices[0].logprobs.content
    assert len(content) == len(ids)
    assert b"".join(bytes(entry.bytes) for entry in content) == script(0).encode()
    assert [entry.token for entry in content] == [hf.decode([t]) for t in ids]


async def test_echo_tokenize_and_detokenize(mesh: Mesh, api: AsyncOpenAI,
                                            hf: PreTrainedTokenizerFast) -> None:
    ids = encode(hf, script(0))
    result = await api.completions.create(model=MODEL, prompt="The fox", echo=True,
                                          max_tokens=len(ids))
    assert result.choices[0].text == "The fox" + script(0)
    text = "Stream the 缓存 block 🤖"
    async with aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/tokenize", json={"prompt": text}) as resp:
            body = await resp.json()
            tokens = body["tokens"]
            assert tokens == list(hf.encode(text)) and body["token_strs"] is None
        async with http.post("/tokenize", json={"prompt": text,
                                                "return_token_strs": True}) as resp:
            assert (await resp.json())["token_strs"] == hf.convert_ids_to_tokens(tokens)
        async with http.post("/tokenize", json={"prompt": text,
                                                "return_token_strs": "yes"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == (
                "return_token_strs")
        async with http.post("/detokenize", json={"tokens": tokens}) as resp:
            assert (await resp.json())["prompt"] == hf.decode(tokens)


async def test_a_prompt_of_megabytes_is_a_context_length_error_at_once(
        api: AsyncOpenAI) -> None:
    # 8 MB of text: seconds of encoding, refused by its size before any (the operator's
    # 7.9 MB prompt once timed out instead, with other requests behind it).
    huge = "The quick brown fox jumps over the lazy dog. " * 180_000
    with pytest.raises(BadRequestError) as raised:
        await api.completions.create(model=MODEL, prompt=huge, max_tokens=4)
    assert raised.value.code == "context_length_exceeded"
    assert raised.value.param == "prompt"
    assert "8100000 characters" in raised.value.message  # refused by its size, not encoded
    with pytest.raises(BadRequestError) as raised:
        await api.chat.completions.create(model=MODEL, max_tokens=4,
                                          messages=[{"role": "user", "content": huge}])
    assert raised.value.code == "context_length_exceeded"
    small = await api.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert small.choices[0].text
