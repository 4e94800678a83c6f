"""The gateway with the real Tokenizer servicer (tiny byte-level BPE, ChatML template).

The fake worker streams the tokenizer's own encoding of each `script(i)`; references
come from the Hugging Face tokenizer directly (encode, apply_chat_template, decode).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
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


async def test_detokenize_refuses_ids_outside_the_vocabulary(
        mesh: Mesh, hf: PreTrainedTokenizerFast) -> None:
    outside = len(hf) + 7
    async with aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/detokenize", json={"tokens": [5, outside]}) as resp:
            status, error = resp.status, (await resp.json())["error"]
        async with http.post("/detokenize", json={"tokens": [len(hf) - 1]}) as resp:
            assert resp.status == 200  # the last id of the vocabulary is in it
            assert (await resp.json())["prompt"] == hf.decode([len(hf) - 1])
    assert status == 400, error
    assert error["message"] == f"Token id {outside} is out of vocabulary"
    assert (error["type"], error["param"]) == ("invalid_request_error", "tokens")


async def test_a_stream_whose_tokenizer_stays_away_ends_with_an_error(
        hf: PreTrainedTokenizerFast) -> None:
    # The only replica dies mid-stream and is not back within the wait: the stream ends
    # with an error event naming the loss (tests/e2e/test_detokenize_failover.py has
    # replicas that come back, and streams that go on).
    served = ServedModel(Tokenizer(hf, name=MODEL), (MODEL,), MAX_MODEL_LEN)
    worker = FakeWorker(encode=lambda text: encode(hf, text),
                        eos=hf.convert_tokens_to_ids("<|endoftext|>"))
    worker.hold_after_first = True  # a long generation: the stream is open at the loss
    async with start_mesh(tokenizer=TokenizerServicer(served), worker=worker,
                          detokenize_failover_wait_s=0.3) as mesh:
        body = {"model": MODEL, "prompt": "The fox", "max_tokens": 100, "stream": True}
        async with aiohttp.ClientSession(mesh.base_url) as http, \
                http.post("/v1/completions", json=body) as resp:
            first = orjson.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])
            await mesh.servers["tokenizer"].drain(grace_s=0)
            events = [e for e in (await resp.read()).split(b"\n\n") if e]
        error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert first["choices"][0]["text"] == script(0)[:len(first["choices"][0]["text"])]
        assert error["code"] == "unavailable"
        assert "the tokenizer detokenizing this response was lost" in error["message"]
        assert "no replica took it over" in error["message"]
        assert events[-1] == b"data: [DONE]"
        registry = mesh.gateway.telemetry.registry
        assert registry.get_sample_value("meshserve:gateway_detokenize_failovers_total",
                                         {"outcome": "unplaced"}) == 1
        await asyncio.wait_for(worker.cancelled.wait(), 10)  # the worker is told to stop


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
