"""Contract tests of Tokenizer.DetokenizeSession: many requests on one stream, one message
a step, answered entry for entry.

References are independent of the service: the model folder's own Hugging Face tokenizer
(`decode` of all ids at once) and `str.find` on the full text for stop strings.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from tokenizer_harness import NAME, Harness
from transformers import PreTrainedTokenizerBase

from meshserve.proto.v1 import tokenizer_pb2 as pb

TEXTS = [
    "The quick brown fox jumps over the lazy dog, said the model to the gateway.",
    "你好世界 模型服务 東京大阪 😀🚀 hello world 🌍🎉 こんにちは 세계안녕",
    "Stream the 缓存 block 🤖 to the worker ✨ and reply 📦 sky river.",
]


def open_request(handle: int, num_sequences: int = 1, model: str = NAME,
                 **options: object) -> pb.DetokenizeOpen:
    return pb.DetokenizeOpen(handle=handle, options=pb.DetokenizeOptions(
        model=model, request_id=f"r{handle}", num_sequences=num_sequences, **options),
        prompt_tails=[pb.TokenIds(token_ids=[5, 6])], samples_per_prompt=num_sequences)


@dataclass
class Step:
    """One message's entries: (handle, index, tokens, final)."""

    entries: list[tuple[int, int, list[int], bool]] = field(default_factory=list)
    opens: list[pb.DetokenizeOpen] = field(default_factory=list)
    lookups: list[int] = field(default_factory=list)
    closes: list[int] = field(default_factory=list)

    def message(self) -> pb.DetokenizeSessionRequest:
        return pb.DetokenizeSessionRequest(
            opens=self.opens, handles=[e[0] for e in self.entries],
            indices=[e[1] for e in self.entries], num_tokens=[len(e[2]) for e in self.entries],
            token_ids=[t for e in self.entries for t in e[2]],
            finals=[e[3] for e in self.entries], stopped_on_tokens=[False] * len(self.entries),
            lookup_token_ids=self.lookups, closes=self.closes)


async def lockstep(harness: Harness, steps: Sequence[Step]
                   ) -> list[pb.DetokenizeSessionResponse]:
    """Send each message and read its answer before the next; then end the stream."""
    call = harness.stub.DetokenizeSession()
    answers = []
    for step in steps:
        await call.write(step.message())
        answers.append(await call.read())
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF, "one answer per message, no more"
    return answers


async def test_many_requests_multiplexed_equal_whole_decodes(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    rng = random.Random(5)
    # 12 requests of 2 sequences each, their chunks interleaved at random across messages.
    wanted: dict[tuple[int, int], list[int]] = {}
    for handle in range(1, 13):
        for index in range(2):
            wanted[handle, index] = hf.encode(TEXTS[(handle + index) % len(TEXTS)])
    pending = {key: list(ids) for key, ids in wanted.items()}
    steps: list[Step] = []
    opened: set[int] = set()
    while pending:
        step = Step()
        for key in rng.sample(sorted(pending), rng.randint(1, len(pending))):
            handle, index = key
            if handle not in opened:
                opened.add(handle)
                step.opens.append(open_request(handle, 2))
            size = rng.choice([1, 2, 3])
            chunk, pending[key] = pending[key][:size], pending[key][size:]
            step.entries.append((handle, index, chunk, not pending[key]))
            if not pending[key]:
                del pending[key]
        steps.append(step)
    answers = await lockstep(harness, steps)
    texts: dict[tuple[int, int], str] = dict.fromkeys(wanted, "")
    counts: dict[tuple[int, int], int] = dict.fromkeys(wanted, 0)
    for step, answer in zip(steps, answers, strict=True):
        assert len(answer.texts) == len(step.entries) == len(answer.finished)
        assert not any(answer.stopped) and not answer.errors
        for (handle, index, chunk, final), text, finished, count in zip(
                step.entries, answer.texts, answer.finished, answer.num_output_tokens,
                strict=True):
            assert "\ufffd" not in text
            texts[handle, index] += text
            counts[handle, index] += len(chunk)
            assert (finished, count) == (final, counts[handle, index])
    assert texts == {key: hf.decode(ids) for key, ids in wanted.items()}
    assert max(len({h for h, *_ in s.entries}) for s in steps) > 6  # really multiplexed


async def test_stop_strings_per_request_and_forgetting(harness: Harness,
                                                       hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode(TEXTS[0])
    stops = {1: ["lazy"], 2: ["fox"], 3: []}
    first = Step(opens=[open_request(h, 1, stop=s) for h, s in stops.items()],
                 entries=[(h, 0, ids, False) for h in stops])
    # Requests 1 and 2 stopped, so they were forgotten: later tokens answer empty.
    later = Step(entries=[(1, 0, ids[:2], False), (3, 0, [], True)], closes=[2])
    after_close = Step(entries=[(2, 0, ids[:1], True)])
    answers = await lockstep(harness, [first, later, after_close])
    full = hf.decode(ids)
    assert list(answers[0].texts) == [full[:full.find("lazy")], full[:full.find("fox")], full]
    assert list(answers[0].stopped) == [True, True, False]
    assert list(answers[0].stop_strings) == ["lazy", "fox"]
    assert list(answers[0].finished) == [True, True, False]
    assert answers[1].texts[0] == "" and answers[1].finished[0]
    assert answers[1].texts[1] == "" and answers[1].finished[1]  # ends at its final
    assert answers[2].texts[0] == "" and answers[2].finished[0]


async def test_bad_opens_and_entries_fail_their_request_alone(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode(TEXTS[2])
    step = Step(opens=[open_request(1, 0), open_request(2, 1, model="other"),
                       open_request(3, 1), open_request(4, 1)],
                entries=[(3, 5, ids[:2], False), (4, 0, ids, True)])
    (answer,) = await lockstep(harness, [step])
    failed = {e.handle: (e.error.kind, e.error.param) for e in answer.errors}
    assert failed == {1: ("invalid_request", "num_sequences"), 2: ("not_found", "model"),
                      3: ("invalid_request", "sequences.index")}
    assert list(answer.texts) == ["", hf.decode(ids)]


async def test_lookups_return_token_bytes(harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode(TEXTS[1])
    (answer,) = await lockstep(harness, [Step(lookups=ids)])
    assert b"".join(answer.token_bytes) == TEXTS[1].encode("utf-8")


async def test_per_entry_arrays_must_agree(harness: Harness) -> None:
    call = harness.stub.DetokenizeSession()
    await call.write(pb.DetokenizeSessionRequest(opens=[open_request(1)], handles=[1],
                                                 indices=[0], num_tokens=[1], token_ids=[5]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_each_request_gets_a_span_in_its_trace(harness: Harness,
                                                     hf: PreTrainedTokenizerBase) -> None:
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    traced = open_request(1)
    traced.traceparent = f"00-{trace_id}-{parent}-01"
    ids = hf.encode(TEXTS[0])
    await lockstep(harness, [Step(opens=[traced, open_request(2)],
                                  entries=[(1, 0, ids, True), (2, 0, ids, True)])])
    spans = [s for s in harness.exporter.get_finished_spans() if s.name == "detokenize"]
    by_request = {(s.attributes or {}).get("gen_ai.request.id"): s for s in spans}
    mine = by_request["r1"]
    assert format(mine.context.trace_id, "032x") == trace_id
    assert mine.parent is not None and format(mine.parent.span_id, "016x") == parent
    assert (mine.attributes or {})["gen_ai.usage.output_tokens"] == len(ids)
    assert format(by_request["r2"].context.trace_id, "032x") != trace_id
