"""Contract tests of the gateway with the real `openai` client against fake services.

The gateway runs on 127.0.0.1 port 0 with fake tokenizer / scheduler / worker grpc.aio
servers (test_gateway_fakes.py); the expected texts and counts follow from the fakes'
scripts (byte-level tokens, `script(i)` per sequence, CHUNK tokens per message).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import aiohttp
import pytest
from openai import AsyncOpenAI, NotFoundError
from test_gateway_fakes import (
    BOS,
    CACHED_TOKENS,
    CHUNK,
    MAX_MODEL_LEN,
    MODEL,
    Mesh,
    script,
    start_mesh,
    token_logprob,
)

from meshserve.proto.v1 import common_pb2

PROMPT = "Hi there"


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with start_mesh() as started:
        yield started


def client(mesh: Mesh, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key=api_key, max_retries=0,
                       timeout=20)


@pytest.fixture
async def api(mesh: Mesh) -> AsyncIterator[AsyncOpenAI]:
    async with client(mesh) as opened:
        yield opened


def head(index: int, num_tokens: int) -> str:
    """The text of the first `num_tokens` tokens (bytes) of sequence `index`'s script."""
    return script(index).encode()[:num_tokens].decode("utf-8", errors="replace")


def messages_for(num_tokens: int) -> int:
    return math.ceil(num_tokens / CHUNK)


async def test_completion_non_streaming(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7)
    assert [c.text for c in result.choices] == [head(0, 7)]
    assert result.choices[0].finish_reason == "length"
    assert result.object == "text_completion" and result.model == MODEL
    prompt_tokens = 1 + len(PROMPT)  # BOS + one token per byte
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 7)
    assert result.usage.prompt_tokens_details is not None
    assert result.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    # One request added with the tokenized prompt; the legacy default of max_tokens not used.
    request = mesh.worker.requests[0]
    assert list(request.prompts[0].token_ids) == [BOS, *PROMPT.encode()]
    assert request.params.max_tokens == 7
    assert mesh.scheduler.routes[0].request_id == request.request_id
    assert list(mesh.scheduler.routes[0].prompt_token_ids) == [BOS, *PROMPT.encode()]


async def test_completion_default_max_tokens_is_16(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.completions.create(model=MODEL, prompt=PROMPT)
    assert mesh.worker.requests[0].params.max_tokens == 16
    assert result.choices[0].text == head(0, 16)


async def test_chat_without_max_tokens_runs_to_the_end(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert not mesh.worker.requests[0].params.HasField("max_tokens")  # up to the context
    choice = result.choices[0]
    assert choice.message.content == script(0) and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    rendered = "<user>hello\n<assistant>"  # the fake template; chat adds no BOS
    assert list(mesh.worker.requests[0].prompts[0].token_ids) == list(rendered.encode())
    # Every byte of the script is a token, and EOS counts as well (as in vLLM).
    assert result.usage is not None
    assert result.usage.completion_tokens == len(script(0).encode()) + 1


async def test_completion_streaming_one_chunk_per_message(mesh: Mesh, api: AsyncOpenAI) -> None:
    stream = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=11,
                                                   stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == head(0, 11)
    # Several tokens per worker message, one chunk per message: never one per token.
    assert len(chunks) == messages_for(11) == mesh.worker.messages_sent
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


async def test_chat_streaming_n2_with_usage(mesh: Mesh, api: AsyncOpenAI) -> None:
    stream = await api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=10,
        stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    first_per_choice = {}
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1  # one choice per chunk, as OpenAI streams n > 1
        choice = chunk.choices[0]
        first_per_choice.setdefault(choice.index, choice.delta)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert {i: d.role for i, d in first_per_choice.items()} == {0: "assistant", 1: "assistant"}
    assert texts == {0: head(0, 10), 1: head(1, 10)}
    assert finish == {0: "length", 1: "length"}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.total_tokens == 20 + usage_chunk.usage.prompt_tokens
    assert mesh.worker.requests[0].params.n == 2 and len(mesh.worker.requests) == 1


async def test_chat_logprobs(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    expected = script(0).encode()[:4]
    assert [entry.token for entry in content] == [chr(b) for b in expected]
    assert [entry.bytes for entry in content] == [[b] for b in expected]
    assert [entry.logprob for entry in content] == [token_logprob(b) for b in expected]
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].top_logprobs[0].token == chr(expected[0])
    assert mesh.worker.requests[0].params.logprobs == 2


async def test_completion_echo_with_logprobs(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.completions.create(model=MODEL, prompt="ab", max_tokens=3,
                                                   echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == "ab" + head(0, 3)
    logprobs = choice.logprobs
    assert logprobs is not None
    # BOS, the prompt bytes, then the output: the first prompt token has no logprob.
    assert logprobs.tokens == ["<special257>", "a", "b", *head(0, 3)]
    assert logprobs.token_logprobs == [None, token_logprob(ord("a")), token_logprob(ord("b")),
                                       *(token_logprob(b) for b in script(0).encode()[:3])]
    assert logprobs.text_offset == [0, 12, 13, 14, 15, 16]


async def test_stop_string_ends_choice_and_aborts_it(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, stop=["wör"])
    for index, choice in enumerate(result.choices):
        assert choice.message.content == script(index).split("wör")[0]
        assert choice.finish_reason == "stop"
        assert choice.model_extra is not None and choice.model_extra["stop_reason"] == "wör"
    # Tokens that count: up to the one completing the stop string, in each sequence.
    counted = sum(len(script(i).split("wör")[0].encode() + "wör".encode()) for i in (0, 1))
    assert result.usage is not None and result.usage.completion_tokens == counted
    await asyncio.wait_for(mesh.worker.aborted.wait(), timeout=5)
    request_id = mesh.worker.requests[0].request_id
    assert all(a.request_id == request_id for a in mesh.worker.aborts)
    # Both sequences stop in the same message: the whole request is aborted at once.
    assert [list(a.indices) for a in mesh.worker.aborts] == [[]]
    assert list(mesh.tokenizer.detokenize_options[0].stop) == ["wör"]


async def test_batched_prompts_and_n_are_one_generate(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.completions.create(model=MODEL, prompt=["a", "bb"], n=2,
                                                   max_tokens=5)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == [head(i, 5) for i in range(4)]
    assert len(mesh.worker.requests) == 1
    request = mesh.worker.requests[0]
    assert [list(p.token_ids) for p in request.prompts] == [[BOS, 97], [BOS, 98, 98]]
    assert request.params.n == 2
    assert mesh.scheduler.routes[0].num_sequences == 4
    # One detokenizer request, each prompt's tail the context of its own n samples.
    (opened,) = mesh.tokenizer.detokenize_opens
    assert [list(t.token_ids) for t in opened.prompt_tails] == [[BOS, 97], [BOS, 98, 98]]
    assert opened.samples_per_prompt == 2 and opened.options.num_sequences == 4
    assert result.usage is not None
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 20
    assert result.usage.prompt_tokens_details.cached_tokens == 2 * CACHED_TOKENS


async def test_token_id_prompt_goes_straight_through(mesh: Mesh, api: AsyncOpenAI) -> None:
    result = await api.completions.create(model=MODEL, prompt=[72, 105], max_tokens=2)
    assert mesh.tokenizer.tokenize_calls == []
    assert list(mesh.worker.requests[0].prompts[0].token_ids) == [72, 105]
    assert result.choices[0].text == head(0, 2)


async def test_models_tokenize_detokenize_version_health(mesh: Mesh, api: AsyncOpenAI) -> None:
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    async with aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/tokenize", json={"model": MODEL, "prompt": "hé"}) as resp:
            assert resp.status == 200
            assert await resp.json() == {"count": 4, "max_model_len": MAX_MODEL_LEN,
                                         "tokens": [BOS, *"hé".encode()], "token_strs": None}
        chat = {"messages": [{"role": "user", "content": "x"}]}
        async with http.post("/tokenize", json=chat) as resp:
            assert (await resp.json())["tokens"] == list(b"<user>x\n<assistant>")
        async with http.post("/detokenize", json={"model": MODEL,
                                                  "tokens": list("hé".encode())}) as resp:
            assert resp.status == 200 and await resp.json() == {"prompt": "hé"}
        async with http.get("/version") as resp:
            assert resp.status == 200 and isinstance((await resp.json())["version"], str)
        async with http.get("/health") as resp:
            assert resp.status == 200
            assert (await resp.json())["workers"] == 1
            assert (await resp.json())["status"] == "ok"
        mesh.scheduler.degraded = True  # the scheduler lost Redis: still serving, degraded
        async with http.get("/health") as resp:
            body = await resp.json()
            assert resp.status == 200 and body["status"] == "degraded"
            assert "Redis" in body["degraded"]
        await mesh.servers["scheduler"].set_serving(False)
        async with http.get("/health") as resp:
            body = await resp.json()
            assert resp.status == 503 and "scheduler" in body["error"]["message"]


async def test_re_routes_when_a_worker_is_unavailable() -> None:
    async with start_mesh(dead_workers=1) as mesh, client(mesh) as api:
        result = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert result.choices[0].text == head(0, 3)
        assert [list(r.exclude_worker_ids) for r in mesh.scheduler.routes] == [[], ["dead0"]]
        assert len(mesh.worker.requests) == 1


async def test_embeddings_are_admitted_by_the_wait_estimate_as_generation_is() -> None:
    # Both kinds of route carry --max-queue-delay-s, so the scheduler refuses with 429
    # what cannot start in time; a route moved after a failure does not (it was admitted).
    async with start_mesh(dead_workers=1, max_queue_delay_s=7.5) as mesh, \
            aiohttp.ClientSession(mesh.base_url) as http:
        async with http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}) as resp:
            await resp.read()
        async with http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                      "max_tokens": 2}) as resp:
            assert resp.status == 200, await resp.text()
        delays = [(r.runner == common_pb2.RUNNER_POOLING, list(r.exclude_worker_ids),
                   r.max_queue_delay_s) for r in mesh.scheduler.routes]
        assert delays == [(True, [], 7.5), (True, ["dead0"], 0.0),
                          (False, [], 7.5), (False, ["dead0"], 0.0)]


async def test_a_model_served_moments_ago_is_routed_not_404() -> None:
    # With no --served-model-name, the gateway knows models from the worker list; a
    # restarted scheduler lists none until the workers register again.
    async with start_mesh(served_model_names=()) as mesh, \
            client(mesh) as api:
        await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        mesh.scheduler.lists_none = True  # routes still place, as a held route would
        with pytest.raises(NotFoundError, match="does not exist"):
            await api.completions.create(model="never-served", prompt=PROMPT, max_tokens=1)
        mesh.scheduler.routes.clear()
        result = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert result.choices[0].text == head(0, 3)
        assert [r.model for r in mesh.scheduler.routes] == [MODEL]
