"""/v1/responses through the gateway with the real `openai` client, fake mesh services
(test_gateway_fakes.py) and a real Redis: answers whole and streamed, stored answers found
by a second gateway on the same Redis, continued with previous_response_id, deleted."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI
from test_gateway_fakes import (
    CACHED_TOKENS,
    CHUNK,
    MODEL,
    Mesh,
    script,
    start_mesh,
    token_logprob,
)

from meshserve.services.gateway.app import Gateway
from meshserve.services.gateway.responses.store import response_key
from meshserve.shared.telemetry import Telemetry

TTL_S = 120.0


@pytest.fixture
async def mesh(redis_url: str) -> AsyncIterator[Mesh]:
    async with start_mesh(redis_url=redis_url, responses_ttl_s=TTL_S) as started:
        yield started


@pytest.fixture
async def api(mesh: Mesh) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=20) as client:
        yield client


@pytest.fixture
async def other(mesh: Mesh) -> AsyncIterator[AsyncOpenAI]:
    """A client of a second gateway in front of the same services and Redis."""
    config = dataclasses.replace(mesh.gateway.config, port=0)
    gateway = Gateway(config, Telemetry("gateway-2"))
    port = await gateway.start()
    try:
        async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=20) as client:
            yield client
    finally:
        await gateway.stop()


def chat_texts(mesh: Mesh, call: int) -> list[tuple[str, str]]:
    """(role, content) of the messages the gateway's `call`-th Tokenize rendered."""
    return [(m.role, m.content) for m in mesh.tokenizer.tokenize_calls[call].chat.messages]


async def test_an_answer_is_a_response_stored_in_redis_and_found_by_another_gateway(
        mesh: Mesh, api: AsyncOpenAI, other: AsyncOpenAI,
        redis_client: aioredis.Redis) -> None:
    answer = await api.responses.create(model=MODEL, input="hello", instructions="be kind",
                                        metadata={"run": "1"})
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.status == "completed" and answer.model == MODEL
    assert answer.output_text == script(0)
    assert chat_texts(mesh, 0) == [("system", "be kind"), ("user", "hello")]
    assert answer.usage is not None
    assert answer.usage.input_tokens == len("<system>be kind\n<user>hello\n<assistant>")
    assert answer.usage.output_tokens == len(script(0).encode()) + 1  # and EOS
    assert answer.usage.input_tokens_details.cached_tokens == CACHED_TOKENS
    ttl_ms = await redis_client.pttl(response_key(answer.id))
    assert 0 < ttl_ms <= TTL_S * 1000
    found = await other.responses.retrieve(answer.id)
    assert found.model_dump() == answer.model_dump()
    assert found.metadata == {"run": "1"} and found.instructions == "be kind"
    for asked, param in (({"stream": True}, "stream"),
                         ({"include": ["message.output_text.logprobs"]}, "include")):
        with pytest.raises(openai.BadRequestError) as refused:
            await other.responses.retrieve(answer.id, **asked)  # type: ignore[call-overload]
        assert refused.value.body["param"] == param  # type: ignore[index]


async def test_previous_response_id_continues_the_stored_conversation(
        mesh: Mesh, api: AsyncOpenAI, other: AsyncOpenAI) -> None:
    first = await api.responses.create(model=MODEL, input="one", instructions="be kind",
                                       max_output_tokens=4)
    assert first.status == "incomplete" and first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert mesh.worker.requests[0].params.max_tokens == 4
    said = script(0)[:4]
    assert first.output_text == said
    second = await other.responses.create(model=MODEL, input="two", previous_response_id=first.id,
                                          instructions="be brief", max_output_tokens=2)
    # Instructions are not carried into continuations: the new ones lead.
    assert chat_texts(mesh, 1) == [("system", "be brief"), ("user", "one"),
                                   ("assistant", said), ("user", "two")]
    assert second.previous_response_id == first.id
    await api.responses.create(model=MODEL, input="three", previous_response_id=second.id,
                               max_output_tokens=2)
    assert chat_texts(mesh, 2) == [("user", "one"), ("assistant", said), ("user", "two"),
                                   ("assistant", script(0)[:2]), ("user", "three")]


async def test_store_false_stores_nothing(api: AsyncOpenAI,
                                          redis_client: aioredis.Redis) -> None:
    answer = await api.responses.create(model=MODEL, input="hi", store=False,
                                        max_output_tokens=3)
    assert answer.store is False and answer.output_text == script(0)[:3]
    assert await redis_client.keys("*resp*") == []
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await api.responses.create(model=MODEL, input="x", previous_response_id=answer.id)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert f"'{answer.id}' not found" in missing.value.message


async def test_input_items_are_listed_page_by_page(api: AsyncOpenAI, other: AsyncOpenAI
                                                   ) -> None:
    answer = await api.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "input_text", "text": "c"}]}])
    pages = other.responses.input_items.list(answer.id, limit=2)
    texts = [item.content[0].text async for item in pages]  # type: ignore[union-attr]
    assert texts == ["c", "b", "a"]  # newest first; a second page after the first two
    first = await other.responses.input_items.list(answer.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["a", "b"]  # type: ignore[union-attr]
    assert first.has_more and first.last_id == first.data[1].id
    with pytest.raises(openai.BadRequestError) as refused:
        await other.responses.input_items.list(answer.id, limit=101)
    assert refused.value.body["param"] == "limit"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await other.responses.input_items.list("resp_nope")


async def test_a_deleted_response_is_gone(api: AsyncOpenAI, other: AsyncOpenAI) -> None:
    answer = await api.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    await other.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.delete(answer.id)


async def test_a_stream_sends_text_as_it_is_generated(mesh: Mesh, api: AsyncOpenAI,
                                                      other: AsyncOpenAI) -> None:
    stream = await api.responses.create(model=MODEL, input="hi", stream=True,
                                        max_output_tokens=10)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # One delta per worker message (CHUNK tokens each), not one per token nor one in all.
    assert len(deltas) == -(-10 // CHUNK) == mesh.worker.messages_sent
    assert "".join(deltas) == script(0)[:10]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == script(0)[:10]
    assert (await other.responses.retrieve(final.id)).output_text == final.output_text


async def test_the_clients_streaming_helper_builds_the_final_response(api: AsyncOpenAI
                                                                      ) -> None:
    async with api.responses.stream(model=MODEL, input="hi") as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.status == "completed" and final.output_text == script(0) == "".join(texts)


@pytest.mark.parametrize("stream", [False, True])
async def test_included_logprobs_come_with_the_text(mesh: Mesh, api: AsyncOpenAI,
                                                    stream: bool) -> None:
    asked = {"model": MODEL, "input": "hi", "max_output_tokens": 7, "top_logprobs": 2,
             "include": ["message.output_text.logprobs"]}
    expected = script(0).encode()[:7]
    if stream:
        events = [e async for e in await api.responses.create(**asked, stream=True)]
        streamed = [lp for e in events if e.type == "response.output_text.delta"
                    for lp in e.logprobs]
        assert [lp.token for lp in streamed] == [chr(b) for b in expected]
        answer = events[-1].response  # type: ignore[union-attr]
    else:
        answer = await api.responses.create(**asked)
    assert mesh.worker.requests[0].params.logprobs == 2
    logprobs = answer.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert [lp.token for lp in logprobs] == [chr(b) for b in expected]
    assert [lp.bytes for lp in logprobs] == [[b] for b in expected]
    assert [lp.logprob for lp in logprobs] == [token_logprob(b) for b in expected]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert answer.top_logprobs == 2


async def test_refusals_name_the_field(api: AsyncOpenAI) -> None:
    for extra, param in (({"reasoning": {"effort": "high"}}, "reasoning"),
                         ({"truncation": "auto"}, "truncation"),
                         ({"max_output_tokens": 0}, "max_output_tokens"),
                         ({"input": [{"role": "user", "content": [
                             {"type": "input_image", "file_id": "file-1"}]}]}, "input")):
        body = {"model": MODEL, "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as refused:
            await api.responses.create(**body)  # type: ignore[call-overload]
        assert refused.value.body["param"] == param  # type: ignore[index]
    harmless = await api.responses.create(model=MODEL, input="hi", reasoning={},
                                          truncation="disabled", include=[],
                                          max_output_tokens=1)
    assert harmless.output_text == script(0)[:1]
