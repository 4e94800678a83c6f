"""Contract tests of the Tokenizer service on a real grpc.aio server on 127.0.0.1.

The model is a tiny folder from tests/tiny_models.py (byte-level BPE with CJK and
emoji, ChatML template). References are independent of the service: the folder's
own Hugging Face tokenizer (encode, apply_chat_template, decode of all ids at
once), `str.find` on the full text for stop strings, and the UTF-8 encoding of
the text for token bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind
from tokenizer_harness import NAME, Harness
from transformers import PreTrainedTokenizerBase

from meshserve.proto.v1 import tokenizer_pb2 as pb
from meshserve.proto.v1 import tokenizer_pb2_grpc
from meshserve.services.tokenizer.__main__ import load_served_model, read_chat_template
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.tokenizer.encode_pool import PromptLimits
from meshserve.services.tokenizer.model import PromptInput, ServedModel
from meshserve.services.tokenizer.service import SERVICE_NAME, TokenizerServicer
from meshserve.shared.errors import ConfigError
from meshserve.shared.grpc_client import GrpcClient, error_from_rpc, wait_until_serving
from meshserve.shared.grpc_server import GrpcServer

SERVING = health_pb2.HealthCheckResponse.SERVING
TEXTS = [
    "The quick brown fox jumps over the lazy dog, said the model to the gateway.",
    "你好世界 模型服务 東京大阪 😀🚀 hello world 🌍🎉 こんにちは 세계안녕",
    "Stream the 缓存 block 🤖 to the worker ✨ and reply 📦 sky river.",
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You serve models."},
    {"role": "user", "content": "Hello 你好 😀, which fox?"},
    {"role": "assistant", "content": "The brown one."},
    {"role": "user", "content": "And the 東京 dog?"},
]
# Renders tools, tool calls, tool answers and a template variable, unlike ChatML.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.tool_call_id %}"
    " ({{ m.tool_call_id }}){% endif %}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {{ greeting }}\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _chat(messages: Sequence[dict[str, Any]]) -> pb.ChatMessages:
    out = []
    for m in messages:
        message = pb.ChatMessage(role=m["role"], tool_call_id=m.get("tool_call_id", ""))
        if m.get("content") is not None:
            message.content = m["content"]
        if "tool_calls" in m:  # as OpenAI sends them: arguments as a JSON string
            message.tool_calls_json = json.dumps([
                {**c, "function": {**c["function"],
                                   "arguments": json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]])
        out.append(message)
    return pb.ChatMessages(messages=out)


def _hf_chat_ids(hf: PreTrainedTokenizerBase, messages: Any, **kwargs: Any) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


async def _rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


# -- Tokenize / CountTokens ------------------------------------------------------------------


async def test_tokenize_text_matches_hf_encode(harness: Harness, hf: PreTrainedTokenizerBase,
                                               tiny_llama_dir: Path) -> None:
    max_len = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    for text in TEXTS:
        reply = await harness.stub.Tokenize(pb.TokenizeRequest(model=NAME, text=text))
        assert list(reply.token_ids) == hf.encode(text)
        assert reply.prompt_text == text and reply.max_model_len == max_len
        plain = await harness.stub.Tokenize(pb.TokenizeRequest(text=text,
                                                               add_special_tokens=False))
        assert list(plain.token_ids) == hf.encode(text, add_special_tokens=False)
    cut = await harness.stub.Tokenize(pb.TokenizeRequest(text=TEXTS[1], truncate_prompt_tokens=5))
    assert list(cut.token_ids) == hf.encode(TEXTS[1])[-5:]
    count = await harness.stub.CountTokens(pb.CountTokensRequest(
        prompt=pb.TokenizeRequest(text=TEXTS[2])))
    assert count.count == len(hf.encode(TEXTS[2])) and count.max_model_len == max_len


async def test_tokenize_chat_matches_hf_apply_chat_template(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    reply = await harness.stub.Tokenize(pb.TokenizeRequest(chat=_chat(MESSAGES)))
    assert list(reply.token_ids) == _hf_chat_ids(hf, MESSAGES, add_generation_prompt=True)
    assert reply.prompt_text == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                       add_generation_prompt=True)
    no_prompt = await harness.stub.Tokenize(pb.TokenizeRequest(chat=_chat(MESSAGES),
                                                               add_generation_prompt=False))
    assert list(no_prompt.token_ids) == _hf_chat_ids(hf, MESSAGES, add_generation_prompt=False)
    assert len(no_prompt.token_ids) < len(reply.token_ids)
    # Content as OpenAI text parts: joined with newlines.
    parts = pb.ChatMessage(role="user", content_parts_json=json.dumps(
        [{"type": "text", "text": "Hello 你好"}, {"type": "text", "text": "fox 🚀"}]))
    joined = await harness.stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(
        messages=[parts])))
    assert list(joined.token_ids) == _hf_chat_ids(
        hf, [{"role": "user", "content": "Hello 你好\nfox 🚀"}], add_generation_prompt=True)
    count = await harness.stub.CountTokens(pb.CountTokensRequest(
        prompt=pb.TokenizeRequest(chat=_chat(MESSAGES))))
    assert count.count == len(reply.token_ids)


async def test_small_prompts_are_answered_while_a_large_one_is_encoded(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    sentence = "The quick brown fox jumps over the lazy dog. "
    keep = 100  # keeping the end makes a prompt this long legitimate for the context
    # 8.1 MB: seconds of encoding, on a busy 2-core box more than the default deadline.
    patient = GrpcClient(method_timeouts_s={"": 300.0}).channel(
        f"127.0.0.1:{harness.server.port}")
    big = asyncio.ensure_future(tokenizer_pb2_grpc.TokenizerStub(patient).Tokenize(
        pb.TokenizeRequest(text=sentence * 180_000, truncate_prompt_tokens=keep)))
    answered_before = 0
    while not big.done():
        reply = await harness.stub.Tokenize(pb.TokenizeRequest(text=TEXTS[0]))
        assert list(reply.token_ids) == hf.encode(TEXTS[0])
        answered_before += not big.done()
    # The event loop kept answering: small prompts finished while the large one ran.
    assert answered_before >= 5, answered_before
    # The text repeats, so its last tokens are those of a shorter repetition.
    assert list((await big).token_ids) == hf.encode(sentence * 1000)[-keep:]
    await patient.close()


async def test_a_prompt_far_longer_than_the_context_fails_at_once(
        harness: Harness, served: ServedModel) -> None:
    text = "x" * (32 * served.max_model_len + 1)  # more than 32 characters a token
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await harness.stub.Tokenize(pb.TokenizeRequest(text=text))
    error = error_from_rpc(raised.value)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.kind, error.param) == ("context_length_exceeded", "prompt")
    messages = [{"role": "user", "content": text}]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await harness.stub.Tokenize(pb.TokenizeRequest(chat=_chat(messages)))
    assert error_from_rpc(raised.value).param == "messages"
    # At the limit the prompt is tokenized (and the context check is the gateway's).
    reply = await harness.stub.Tokenize(pb.TokenizeRequest(text=text[:-1]))
    assert len(reply.token_ids) > 0


async def test_max_prompt_chars_refuses_longer_prompts(served: ServedModel) -> None:
    servicer = TokenizerServicer(served, limits=PromptLimits(max_prompt_chars=10))
    server = GrpcServer("127.0.0.1:0", service_names=[SERVICE_NAME], grace_s=0)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server.server)
    port = await server.start()
    await server.set_serving()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    try:
        assert len((await stub.Tokenize(pb.TokenizeRequest(text="0123456789"))).token_ids) > 0
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Tokenize(pb.TokenizeRequest(text="0123456789a", truncate_prompt_tokens=2))
        error = error_from_rpc(raised.value)
        assert (error.kind, error.param) == ("invalid_request", "prompt")
        assert "--max-prompt-chars" in error.message
    finally:
        await channel.close()
        await server.drain(grace_s=0)


async def test_tools_template_override_and_kwargs_reach_the_template(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "東京"}}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny 😀", "tool_call_id": "call_1"}]
    request = pb.TokenizeRequest(chat=_chat(messages), tools_json=json.dumps(TOOLS),
                                 chat_template=TOOLS_TEMPLATE,
                                 chat_template_kwargs_json=json.dumps({"greeting": "hey"}))
    reply = await harness.stub.Tokenize(request)
    reference = [{**m, "content": m["content"] or ""} for m in messages]
    expected = hf.apply_chat_template(reference, tools=TOOLS, chat_template=TOOLS_TEMPLATE,
                                      add_generation_prompt=True, greeting="hey",
                                      tokenize=False)
    assert reply.prompt_text == expected
    assert "TOOLS:[get_weather]" in expected and 'CALL get_weather {"city":' in expected
    assert "(call_1)" in expected and expected.endswith("assistant hey\n")
    assert list(reply.token_ids) == hf.encode(expected, add_special_tokens=False)


async def test_bad_requests_fail_alone_with_invalid_argument(harness: Harness,
                                                             hf: PreTrainedTokenizerBase) -> None:
    cases = {
        "messages": pb.TokenizeRequest(chat=pb.ChatMessages()),
        "messages[0].role": pb.TokenizeRequest(chat=_chat([{"role": "",
                                                            "content": "hi"}])),
        "input": pb.TokenizeRequest(),
        "tools": pb.TokenizeRequest(chat=_chat(MESSAGES), tools_json="{not json"),
        "chat_template_kwargs": pb.TokenizeRequest(chat=_chat(MESSAGES),
                                                   chat_template_kwargs_json="[1]"),
        "tools_json": pb.TokenizeRequest(text="hi", tools_json=json.dumps(TOOLS)),
    }
    for param, request in cases.items():
        error = await _rpc_error(harness.stub.Tokenize(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, error)
        assert error_from_rpc(error).param == param
    unknown = await _rpc_error(harness.stub.Tokenize(pb.TokenizeRequest(model="gpt-9", text="x")))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    # The server kept serving.
    reply = await harness.stub.Tokenize(pb.TokenizeRequest(text=TEXTS[0]))
    assert list(reply.token_ids) == hf.encode(TEXTS[0])
    health = await health_pb2_grpc.HealthStub(harness.channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert health.status == SERVING


# -- detokenization, over DetokenizeSession ---------------------------------------------------
# One request per stream (handle 1, opened with the first message); each step's entries
# and answers are read back per sequence, as the gateway's detokenize link does.

HANDLE = 1


@dataclass
class Seq:
    """New tokens of one sequence in one message (one entry of a DetokenizeSessionRequest)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    final: bool = False
    lookup_token_ids: list[int] = field(default_factory=list)


@dataclass
class Text:
    """The answer to one entry."""

    index: int
    text: str
    stopped: bool
    stop_string: str
    finished: bool
    num_output_tokens: int
    token_bytes: list[bytes]


@dataclass
class Answer:
    """The answer to one message, entry for entry."""

    sequences: list[Text]
    errors: list[pb.HandleError]


def _options(num_sequences: int, prompt_token_ids: Sequence[int] = (),
             **kwargs: Any) -> pb.DetokenizeOpen:
    return pb.DetokenizeOpen(
        handle=HANDLE, options=pb.DetokenizeOptions(model=NAME, request_id="r1",
                                                    num_sequences=num_sequences, **kwargs),
        prompt_tails=[pb.TokenIds(token_ids=prompt_token_ids)], samples_per_prompt=num_sequences)


def _delta(*sequences: Seq) -> list[Seq]:
    return list(sequences)


def _message(delta: Sequence[Seq], opens: Sequence[pb.DetokenizeOpen] = ()
             ) -> pb.DetokenizeSessionRequest:
    return pb.DetokenizeSessionRequest(
        opens=opens, handles=[HANDLE] * len(delta), indices=[s.index for s in delta],
        num_tokens=[len(s.token_ids) for s in delta],
        token_ids=[t for s in delta for t in s.token_ids], finals=[s.final for s in delta],
        stopped_on_tokens=[False] * len(delta),
        lookup_token_ids=[t for s in delta for t in s.lookup_token_ids])


def _answer(delta: Sequence[Seq], response: pb.DetokenizeSessionResponse) -> Answer:
    """Per-entry answers; stop strings and token bytes handed back to their entries."""
    stops, raw = iter(response.stop_strings), iter(response.token_bytes)
    texts = [Text(s.index, text, stopped, next(stops) if stopped else "", finished, count,
                  [next(raw) for _ in s.lookup_token_ids])
             for s, text, stopped, finished, count in zip(
                 delta, response.texts, response.stopped, response.finished,
                 response.num_output_tokens, strict=True)]
    return Answer(texts, list(response.errors))


async def _lockstep(stub: tokenizer_pb2_grpc.TokenizerStub, options: pb.DetokenizeOpen,
                    deltas: Sequence[Sequence[Seq]]) -> list[Answer]:
    """Open the request with the first message, send each delta and read its answer before
    sending the next one; then end the stream."""
    call = stub.DetokenizeSession()
    answers = []
    for i, delta in enumerate(deltas):
        await call.write(_message(delta, [options] if i == 0 else []))
        answers.append(_answer(delta, await call.read()))
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF, "one answer per message, no more"
    return answers


def _chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.choice([1, 1, 2, 3, 5])
        chunks.append(ids[start:start + size])
        start += size
    return chunks


def _assert_splits_characters(hf: PreTrainedTokenizerBase, ids: list[int]) -> None:
    """The test means something only if some character spans several tokens."""
    assert any("\ufffd" in hf.decode([t]) for t in ids), "no multi-token character"


async def test_multi_sequence_chunked_deltas_never_break_characters(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    rng = random.Random(7)
    ids = [hf.encode(text) for text in TEXTS]
    _assert_splits_characters(hf, ids[1])
    chunks = [_chunked(seq_ids, rng) for seq_ids in ids]
    deltas, order = [], []
    sent = [0] * len(TEXTS)
    while any(chunks):
        # Each delta carries a random subset of the sequences that still have chunks.
        live = [i for i, c in enumerate(chunks) if c]
        picked = sorted(rng.sample(live, rng.randint(1, len(live))), reverse=rng.random() < .5)
        entries = []
        for i in picked:
            tokens = chunks[i].pop(0)
            sent[i] += len(tokens)
            entries.append(Seq(index=i, token_ids=tokens, final=not chunks[i]))
        deltas.append(_delta(*entries))
        order.append([(i, sent[i], not chunks[i]) for i in picked])
    answers = await _lockstep(harness.stub, _options(len(TEXTS), prompt_token_ids=[5, 6, 7]),
                              deltas)
    texts = [""] * len(TEXTS)
    for answer, expected in zip(answers, order, strict=True):
        assert [(s.index, s.num_output_tokens, s.finished) for s in answer.sequences] == expected
        for s in answer.sequences:
            assert "\ufffd" not in s.text and not s.stopped
            texts[s.index] += s.text
    assert texts == [hf.decode(seq_ids, skip_special_tokens=True) for seq_ids in ids]


def _first_count_containing(hf: PreTrainedTokenizerBase, ids: list[int], stop: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if stop in hf.decode(ids[:k]))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
async def test_stop_strings_across_token_boundaries(harness: Harness, hf: PreTrainedTokenizerBase,
                                                    include: bool, chunk: int) -> None:
    stops = ["jumps over", "世界 模"]
    for text, stop in zip(TEXTS[:2], stops, strict=True):
        ids = hf.encode(text) + hf.encode(" and more after the stop")
        full = hf.decode(ids)
        at = _first_count_containing(hf, ids, stop)
        assert stop not in hf.decode(ids[at - 1:at]), "the stop string must span tokens"
        chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
        deltas = [_delta(Seq(index=0, token_ids=c, final=i == len(chunks) - 1))
                  for i, c in enumerate(chunks)]
        answers = await _lockstep(harness.stub, _options(
            1, stop=[stop, "never there"], include_stop_str_in_output=include), deltas)
        end = full.find(stop) + (len(stop) if include else 0)
        assert "".join(a.sequences[0].text for a in answers) == full[:end]
        hit = next(i for i, a in enumerate(answers) if a.sequences[0].stopped)
        s = answers[hit].sequences[0]
        assert (s.stopped, s.finished, s.stop_string, s.num_output_tokens) == (
            True, True, stop, at)
        for a in answers[hit + 1:]:  # later deltas: the request is forgotten, nothing more
            s = a.sequences[0]
            assert (s.text, s.stopped, s.finished) == ("", False, True)
        assert all(not a.sequences[0].finished for a in answers[:hit])
        assert hit == (at - 1) // chunk


async def test_min_tokens_hides_early_stop_strings(harness: Harness,
                                                   hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode("the fox and the dog and the fox again")
    min_tokens = _first_count_containing(hf, ids, "fox") + 1
    head = hf.decode(ids[:min_tokens])
    rest = hf.decode(ids)[len(head):]
    deltas = [_delta(Seq(index=0, token_ids=[t])) for t in ids]
    answers = await _lockstep(harness.stub, _options(1, stop=["fox"], min_tokens=min_tokens),
                              deltas)
    assert "".join(a.sequences[0].text for a in answers) == head + rest[:rest.find("fox")]
    assert [a.sequences[0].stopped for a in answers].count(True) == 1


async def test_skip_special_tokens(harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode("<|im_start|>assistant\nhello 你好 😀<|im_end|>\n<|endoftext|>")
    skipped = hf.decode(ids, skip_special_tokens=True)
    kept = hf.decode(ids, skip_special_tokens=False)
    assert skipped != kept and "<|im_end|>" in kept
    for skip, expected in ((True, skipped), (False, kept)):
        deltas = [_delta(Seq(index=0, token_ids=ids[i:i + 2]))
                  for i in range(0, len(ids), 2)]
        deltas.append(_delta(Seq(index=0, final=True)))
        answers = await _lockstep(harness.stub, _options(1, skip_special_tokens=skip), deltas)
        assert "".join(a.sequences[0].text for a in answers) == expected
        assert answers[-1].sequences[0].finished


async def test_lookup_token_bytes(harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    text = TEXTS[1]
    ids = hf.encode(text)
    _assert_splits_characters(hf, ids)
    extra = [ids[-1], ids[0]]  # "alternatives" need not be the sequence's own tokens
    answers = await _lockstep(harness.stub, _options(2), [
        _delta(Seq(index=0, token_ids=ids[:4], lookup_token_ids=ids[:4]),
               Seq(index=1, token_ids=[ids[0]], lookup_token_ids=extra)),
        _delta(Seq(index=0, token_ids=ids[4:], lookup_token_ids=ids[4:]))])
    looked_up = list(answers[0].sequences[0].token_bytes) + list(answers[1].sequences[0].token_bytes)
    assert b"".join(looked_up) == text.encode("utf-8")
    for token, raw in zip(ids, looked_up, strict=True):
        single = hf.decode([token])
        if "\ufffd" not in single:  # whole characters: the token's own text
            assert raw.decode("utf-8") == single
    assert list(answers[0].sequences[1].token_bytes) == [looked_up[-1], looked_up[0]]


async def test_bad_requests_fail_alone_on_their_stream(harness: Harness,
                                                      hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode(TEXTS[0])
    bad = {2: (_options(2), Seq(index=2, token_ids=[5]), "sequences.index"),
           3: (_options(0), Seq(index=0, token_ids=[5]), "num_sequences"),
           4: (_options(1, stop=[""]), Seq(index=0, token_ids=[5]), "stop")}
    opens = []
    for handle, (options, _, _) in bad.items():
        options.handle = handle
        opens.append(options)
    good = _options(1)
    message = _message([Seq(index=0, token_ids=ids, final=True)], [good, *opens])
    # Entries of the bad requests, and of one never opened (handle 9), ride along.
    for handle, (_, entry, _) in [*bad.items(), (9, (None, Seq(index=0, token_ids=[5]), ""))]:
        message.handles.append(handle)
        message.indices.append(entry.index)
        message.num_tokens.append(len(entry.token_ids))
        message.token_ids.extend(entry.token_ids)
        message.finals.append(False)
        message.stopped_on_tokens.append(False)
    call = harness.stub.DetokenizeSession()
    await call.write(message)
    answer = await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    failed = {e.handle: (e.error.kind, e.error.param) for e in answer.errors}
    assert failed == {h: ("invalid_request", param) for h, (_, _, param) in bad.items()}
    assert list(answer.texts) == [hf.decode(ids), "", "", "", ""]
    assert list(answer.finished) == [True] * 5


async def test_concurrent_streams_do_not_interfere(harness: Harness,
                                                   hf: PreTrainedTokenizerBase) -> None:
    a_ids, b_ids = hf.encode(TEXTS[1]), hf.encode(TEXTS[0])
    a, b = harness.stub.DetokenizeSession(), harness.stub.DetokenizeSession()
    # The same handle on both streams: each stream's requests are its own.
    opens = {a: [_options(1)], b: [_options(1, stop=["lazy"])]}

    async def send(call: Any, seq: Seq) -> None:
        await call.write(_message([seq], opens.pop(call, [])))

    async def text(call: Any) -> str:
        return str((await call.read()).texts[0])

    a_text = b_text = ""
    for i in range(max(len(a_ids), len(b_ids))):
        # Interleave the two streams' messages on the wire, answers read in reverse.
        if i < len(a_ids):
            await send(a, Seq(index=0, token_ids=[a_ids[i]]))
        if i < len(b_ids):
            await send(b, Seq(index=0, token_ids=[b_ids[i]]))
            b_text += await text(b)
        if i < len(a_ids):
            a_text += await text(a)
    await send(a, Seq(index=0, final=True))
    a_text += await text(a)
    for call in (a, b):
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    assert a_text == hf.decode(a_ids)
    b_full = hf.decode(b_ids)
    assert b_text == b_full[:b_full.find("lazy")]


async def test_spans_and_metrics(harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode(TEXTS[0])
    await harness.stub.Tokenize(pb.TokenizeRequest(text=TEXTS[0]))
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    options = _options(1)
    options.traceparent = f"00-{trace_id}-{parent_id}-01"
    await _lockstep(harness.stub, options, [
        _delta(Seq(index=0, token_ids=ids[:3])),
        _delta(Seq(index=0, token_ids=ids[3:], final=True))])
    spans = {s.name: s for s in harness.exporter.get_finished_spans()}
    parent = spans["meshserve.v1.Tokenizer/Tokenize"]
    assert parent.kind == SpanKind.SERVER
    assert spans["tokenize"].parent is not None
    assert spans["tokenize"].parent.span_id == parent.context.span_id
    # A request's detokenize span joins the trace it was opened with, not the stream's.
    detokenize = spans["detokenize"]
    assert format(detokenize.context.trace_id, "032x") == trace_id
    assert detokenize.parent is not None
    assert format(detokenize.parent.span_id, "016x") == parent_id
    assert spans["tokenize"].attributes["gen_ai.usage.input_tokens"] == len(ids)
    assert spans["detokenize"].attributes["gen_ai.usage.output_tokens"] == len(ids)
    assert spans["detokenize"].attributes["gen_ai.request.id"] == "r1"
    sample = harness.telemetry.registry.get_sample_value
    assert sample("meshserve:tokenizer_requests_total", {"method": "tokenize"}) == 1
    assert sample("meshserve:tokenizer_requests_total", {"method": "detokenize"}) == 1
    assert sample("meshserve:tokenizer_tokens_total", {"direction": "tokenize"}) == len(ids)
    assert sample("meshserve:tokenizer_tokens_total", {"direction": "detokenize"}) == len(ids)
    assert sample("meshserve:tokenizer_latency_seconds_count",
                  {"operation": "detokenize_step"}) == 2


async def test_unavailable_and_not_serving_until_the_model_is_set(
        served: ServedModel, hf: PreTrainedTokenizerBase) -> None:
    server = GrpcServer("127.0.0.1:0", service_names=[SERVICE_NAME], grace_s=5)
    servicer = TokenizerServicer()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server.server)
    port = await server.start()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        error = await _rpc_error(stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        servicer.set_model(served)
        await server.set_serving()
        await wait_until_serving(channel, SERVICE_NAME, timeout_s=10)
        reply = await stub.Tokenize(pb.TokenizeRequest(text=TEXTS[1]))
        assert list(reply.token_ids) == hf.encode(TEXTS[1])
    finally:
        await channel.close()
        await server.drain(grace_s=0)


def test_server_chat_template_from_file_or_inline(tiny_llama_dir: Path, tmp_path: Path,
                                                  hf: PreTrainedTokenizerBase) -> None:
    template_file = tmp_path / "tools.jinja"
    template_file.write_text(TOOLS_TEMPLATE, encoding="utf-8")
    assert read_chat_template(None) is None
    assert read_chat_template(str(template_file)) == TOOLS_TEMPLATE
    assert read_chat_template(TOOLS_TEMPLATE) == TOOLS_TEMPLATE
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    model = load_served_model(TokenizerConfig(model=str(tiny_llama_dir),
                                              chat_template=str(template_file)))
    assert model.names == (str(tiny_llama_dir),)
    prompt = model.tokenize(PromptInput(messages=MESSAGES, tools=TOOLS, add_special_tokens=False,
                                        chat_template_kwargs={"greeting": "hi"}))
    assert prompt.text == hf.apply_chat_template(
        MESSAGES, tools=TOOLS, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
        greeting="hi", tokenize=False)
    assert prompt.text.startswith("TOOLS:[get_weather]")


# -- the service process ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_main_serves_after_load_and_drains_on_sigterm(
        tiny_llama_dir: Path, hf: PreTrainedTokenizerBase) -> None:
    port, metrics_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshserve.services.tokenizer", "--model", str(tiny_llama_dir),
        "--served-model-name", NAME, "--port", str(port), "--metrics-port", str(metrics_port),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    logs = asyncio.ensure_future(proc.stderr.read())  # drained all along: the pipe never fills
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    try:
        serving = asyncio.ensure_future(wait_until_serving(channel, SERVICE_NAME, timeout_s=120))
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({serving, exited}, return_when=asyncio.FIRST_COMPLETED)
        assert not exited.done(), f"exited early: {(await logs).decode()}"
        await serving
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        reply = await stub.Tokenize(pb.TokenizeRequest(model=NAME, chat=_chat(MESSAGES)))
        assert list(reply.token_ids) == _hf_chat_ids(hf, MESSAGES, add_generation_prompt=True)
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{metrics_port}/metrics") as response:
            assert 'meshserve:tokenizer_requests_total{method="tokenize"} 1.0' in \
                await response.text()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(exited, 60)
        text = (await logs).decode()
        assert code == 0, text
        assert '"message":"tokenizer serving"' in text and '"message":"gRPC server stopped"' in text
    finally:
        await channel.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
