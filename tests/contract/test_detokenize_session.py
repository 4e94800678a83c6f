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


async def test_a_resumed_request_goes_on_where_the_old_stream_stopped(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    # The first stream answers TEXTS[1] a token a step up to the cut (inside a character,
    # for some cuts), then breaks; the second opens the request with where it stood.
    ids = hf.encode(TEXTS[1])
    full = hf.decode(ids)
    for cut in (1, len(ids) // 3, len(ids) // 2, len(ids) - 1):
        before = await lockstep(harness, [
            Step(opens=[open_request(1, 2)] if i == 0 else [], entries=[(1, 0, [t], False)])
            for i, t in enumerate(ids[:cut])])
        sent = "".join(a.texts[0] for a in before)
        resumed = open_request(1, 2)
        resumed.resumed.extend([
            pb.DetokenizeResume(index=0, token_ids=ids[:cut], text=sent),
            pb.DetokenizeResume(index=1, finished=True)])
        after = await lockstep(harness, [
            Step(opens=[resumed], entries=[(1, 0, ids[cut:], True)]),
            Step(entries=[(1, 0, [], True)])])
        assert sent + after[0].texts[0] == full, cut
        assert (after[0].finished[0], after[0].num_output_tokens[0]) == (True, len(ids))
        assert not after[0].errors
        assert after[1].texts[0] == "" and after[1].num_output_tokens[0] == 0  # forgotten


async def test_bad_resumes_and_unknown_ids_fail_their_request_alone(
        harness: Harness, hf: PreTrainedTokenizerBase) -> None:
    ids = hf.encode(TEXTS[0])
    twice = open_request(1)
    twice.resumed.extend([pb.DetokenizeResume(index=0, token_ids=ids[:2], text="x"),
                          pb.DetokenizeResume(index=0, token_ids=ids[:2], text="x")])
    outside = open_request(2)
    outside.resumed.append(pb.DetokenizeResume(index=3))
    checked = open_request(3, check_vocabulary=True)
    (answer,) = await lockstep(harness, [Step(
        opens=[twice, outside, checked, open_request(4)],
        entries=[(3, 0, [ids[0], len(hf) + 2], True), (4, 0, [len(hf) + 2, *ids], True)])])
    failed = {e.handle: (e.error.kind, e.error.param, e.error.message) for e in answer.errors}
    assert failed == {
        1: ("invalid_request", "resumed.index",
            "sequence 0 is resumed twice, or after its first tokens"),
        2: ("invalid_request", "sequences.index",
            "sequence index 3 is out of range: the options declared 1 sequences"),
        3: ("invalid_request", "tokens", f"Token id {len(hf) + 2} is out of vocabulary")}
    assert list(answer.texts) == ["", hf.decode(ids)]  # unchecked: the unknown id is nothing
