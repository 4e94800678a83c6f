"""Contract tests of Worker.Session: many requests on one stream, one message per step.

A real grpc.aio server on 127.0.0.1 over a real engine (tests/worker_harness.py); each
request's tokens must equal the same engine's run of that request alone, in process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from worker_harness import (
    NUM_BLOCKS,
    PROMPTS,
    Harness,
    greedy,
    ref_tokens,
    reference,
    request,
    wait_idle,
)

from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from meshserve.shared.sampling_params import SamplingParams

ABORT = common_pb2.FINISH_REASON_ABORT
FILL = 250  # prompt + output tokens of a long request (the harness's context is 256)
UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class Seen:
    """Everything a session said about one handle."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    reasons: dict[int, int] = field(default_factory=dict)
    details: list[worker_pb2.EntryDetail] = field(default_factory=list)
    logprobs: dict[int, list[common_pb2.TokenLogprobs]] = field(default_factory=dict)
    error: common_pb2.Error | None = None
    done: int = 0
    entries_after_done: int = 0


class Session:
    """The client side of one Session stream, recording what comes back per handle."""

    def __init__(self, worker: Harness, *, metadata: Sequence[tuple[str, str]] = (),
                 stub: worker_pb2_grpc.WorkerStub | None = None) -> None:
        """`stub`: another channel's stub to the worker (default: the harness's)."""
        self.queue: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()
        self.call = (stub or worker.stub).Session(self._requests(), metadata=metadata or None)
        self.seen: dict[int, Seen] = {}
        self.messages: list[worker_pb2.SessionResponse] = []

    async def _requests(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while (message := await self.queue.get()) is not None:
            yield message

    def send(self, *, adds: Sequence[worker_pb2.SessionAdd] = (),
             aborts: Sequence[worker_pb2.SessionAbort] = ()) -> None:
        self.queue.put_nowait(worker_pb2.SessionRequest(adds=adds, aborts=aborts))

    def half_close(self) -> None:
        self.queue.put_nowait(None)

    def record(self, message: worker_pb2.SessionResponse) -> None:
        self.messages.append(message)
        details = {d.entry: d for d in message.details}
        position = 0
        for entry, (handle, index, size, reason) in enumerate(zip(
                message.handles, message.indices, message.num_tokens, message.finish_reasons,
                strict=True)):
            seen = self.seen.setdefault(handle, Seen())
            if seen.done:
                seen.entries_after_done += 1
            seen.tokens.setdefault(index, []).extend(message.token_ids[position:position + size])
            position += size
            if reason != UNSET:
                assert index not in seen.reasons, f"sequence {index} of {handle} ended twice"
                seen.reasons[index] = reason
            if entry in details:
                seen.details.append(details[entry])
                seen.logprobs.setdefault(index, []).extend(details[entry].logprobs)
        assert position == len(message.token_ids)
        for failed in message.errors:
            self.seen.setdefault(failed.handle, Seen()).error = failed.error
        for done in message.done:
            self.seen.setdefault(done.handle, Seen()).done += 1

    async def until(self, handles: Sequence[int], timeout_s: float = 30.0) -> None:
        """Read until every one of `handles` is done or failed."""
        async with asyncio.timeout(timeout_s):
            while not all(h in self.seen and (self.seen[h].done or self.seen[h].error)
                          for h in handles):
                message = await self.call.read()
                assert message is not grpc.aio.EOF, "the session ended early"
                self.record(message)


def add(handle: int, rid: str, prompts: list[list[int]], params: common_pb2.SamplingParams,
        **fields: object) -> worker_pb2.SessionAdd:
    return worker_pb2.SessionAdd(handle=handle, request=request(rid, prompts, params), **fields)


async def test_requests_share_messages_and_match_the_engine_alone(
        worker: Harness, tiny_llama_dir: Path) -> None:
    session = Session(worker)
    session.send(adds=[add(i + 1, f"r{i}", [p], greedy(12, ignore_eos=True))
                       for i, p in enumerate(PROMPTS)])
    await session.until([1, 2, 3])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        seen = session.seen[i + 1]
        assert seen.tokens[0] == ref_tokens(reference(tiny_llama_dir, prompt, params)[0])
        assert seen.reasons == {0: common_pb2.FINISH_REASON_LENGTH}
        assert seen.done == 1 and seen.error is None and seen.entries_after_done == 0
        (first,) = [d for d in seen.details if d.HasField("cached_tokens")]
        assert first.cached_tokens == 0
    # One message per step for all requests: far fewer messages than requests x tokens,
    # and most of them carry several requests.
    assert len(session.messages) < 3 * 12
    assert max(len(set(m.handles)) for m in session.messages) == 3
    session.half_close()
    assert await session.call.read() is grpc.aio.EOF  # ends after its last request


async def test_logprobs_prompt_logprobs_and_n_ride_in_details(worker: Harness,
                                                              tiny_llama_dir: Path) -> None:
    session = Session(worker)
    wire = common_pb2.SamplingParams(n=2, temperature=0.7, seed=9, max_tokens=6,
                                     ignore_eos=True, logprobs=2, prompt_logprobs=1)
    session.send(adds=[add(5, "lp", [PROMPTS[0]], wire)])
    await session.until([5])
    params = SamplingParams(n=2, temperature=0.7, seed=9, max_tokens=6, ignore_eos=True,
                            logprobs=2, prompt_logprobs=1)
    expected = reference(tiny_llama_dir, PROMPTS[0], params)
    seen = session.seen[5]
    for index in (0, 1):
        assert seen.tokens[index] == ref_tokens(expected[index])
    logprobs = [lp for d in seen.details for lp in d.logprobs]
    assert len(logprobs) == 12 and all(len(lp.top_token_ids) == 2 for lp in logprobs)
    prompt_logprobs = [d.prompt_logprobs for d in seen.details if d.prompt_logprobs]
    assert [len(p) for p in prompt_logprobs] == [len(PROMPTS[0]) - 1] * 2


async def test_a_resumed_add_runs_the_listed_sequences_on_from_their_tokens(
        worker: Harness, tiny_llama_dir: Path) -> None:
    """Two prompts x n=2, seeded: sequence 1 had finished on the lost worker, 0 and 3 had
    some tokens, 2 none; each runs on from there, with entries holding only new tokens."""
    wire = common_pb2.SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10,
                                     ignore_eos=True)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]
    whole = {p * 2 + s: ref_tokens(outs) for p, prompt in enumerate(prompts)
             for s, outs in reference(tiny_llama_dir, prompt, params).items()}
    carried = {0: whole[0][:3], 2: [], 3: whole[3][:9]}
    session = Session(worker)
    session.send(adds=[add(8, "moved", prompts, wire, resumed=[
        worker_pb2.ResumedSequence(index=i, token_ids=t) for i, t in carried.items()])])
    await session.until([8])
    seen = session.seen[8]
    assert seen.error is None
    assert seen.tokens == {i: whole[i][len(t):] for i, t in carried.items()}
    assert seen.reasons == dict.fromkeys(carried, common_pb2.FINISH_REASON_LENGTH)
    # Cached tokens are of the prompt only (the resumed tokens' blocks may hit too).
    assert all(d.cached_tokens <= len(PROMPTS[2]) for d in seen.details)
    session.send(adds=[add(9, "bad", prompts, wire, resumed=[
        worker_pb2.ResumedSequence(index=0, token_ids=whole[0])])])
    await session.until([9])
    error = session.seen[9].error
    assert error is not None and error.kind == "invalid_request" and error.param == "resumed"


async def test_bad_add_fails_alone_and_aborts_end_sequences(worker: Harness) -> None:
    session = Session(worker)
    session.send(adds=[add(1, "bad", [PROMPTS[0]], common_pb2.SamplingParams(temperature=-1.0)),
                       add(2, "long", [PROMPTS[1]], common_pb2.SamplingParams(
                           n=2, temperature=0.0, max_tokens=200, ignore_eos=True)),
                       add(3, "ok", [PROMPTS[2]], greedy(5, ignore_eos=True))])
    await session.until([1, 3])
    assert session.seen[1].error is not None
    assert session.seen[1].error.kind == "invalid_request"
    assert session.seen[1].error.param == "temperature"
    assert len(session.seen[3].tokens[0]) == 5
    session.send(aborts=[worker_pb2.SessionAbort(handle=2, indices=[1])])
    # Sequence 1 ends aborted; sequence 0 goes on to its length.
    await session.until([2])
    assert session.seen[2].reasons == {1: ABORT, 0: common_pb2.FINISH_REASON_LENGTH}
    assert len(session.seen[2].tokens[0]) == 200
    load = await wait_idle(worker, within_s=10)
    assert load.load.num_used_blocks == 0


async def test_deadline_fails_the_request_and_frees_its_blocks(worker: Harness) -> None:
    session = Session(worker)
    late = add(1, "late", [PROMPTS[1]], greedy(FILL - len(PROMPTS[1]), ignore_eos=True))
    # Far less than ~200 engine steps take: the deadline ends it.
    late.request.deadline_unix_ns = time.time_ns() + 50_000_000
    session.send(adds=[late, add(2, "fine", [PROMPTS[0]], greedy(3))])
    await session.until([1, 2])
    error = session.seen[1].error
    assert error is not None and error.kind == "deadline_exceeded"
    assert session.seen[2].done == 1 and len(session.seen[2].tokens[0]) == 3
    load = await wait_idle(worker, within_s=5)
    assert load.load.num_free_blocks == NUM_BLOCKS


async def test_closing_the_session_aborts_everything(worker: Harness) -> None:
    session = Session(worker)
    session.send(adds=[add(i, f"c{i}", [p], greedy(FILL - len(p), ignore_eos=True))
                       for i, p in enumerate(PROMPTS)])
    first = await session.call.read()  # generation is under way
    assert first is not grpc.aio.EOF and len(first.token_ids) > 0
    busy = (await worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
    assert busy.num_running == 3 and busy.num_free_blocks < NUM_BLOCKS
    session.call.cancel()  # the gateway went away
    load = await wait_idle(worker, within_s=5)
    assert load.load.num_free_blocks == NUM_BLOCKS


async def test_draining_refuses_adds_and_ends_the_session_after_its_last_request(
        worker: Harness) -> None:
    session = Session(worker)
    session.send(adds=[add(1, "running", [PROMPTS[0]],
                           greedy(FILL - len(PROMPTS[0]), ignore_eos=True))])
    first = await session.call.read()  # request 1 runs: the session is not idle
    assert first is not grpc.aio.EOF
    session.record(first)
    worker.draining[0] = True
    worker.servicer.wake_sessions()
    session.send(adds=[add(2, "refused", [PROMPTS[0]], greedy(3))])
    await session.until([2])
    assert session.seen[2].error is not None and session.seen[2].error.kind == "unavailable"
    session.send(aborts=[worker_pb2.SessionAbort(handle=1)])
    await session.until([1])
    assert session.seen[1].reasons == {0: ABORT}
    assert await session.call.read() is grpc.aio.EOF  # nothing left: the session ends


async def test_each_request_joins_the_trace_it_carries(worker: Harness) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    session = Session(worker)
    session.send(adds=[add(1, "traced", [PROMPTS[0]], greedy(3),
                           traceparent=f"00-{trace_id}-{parent}-01"),
                       add(2, "untraced", [PROMPTS[1]], greedy(3))])
    await session.until([1, 2])
    spans = [s for s in worker.exporter.get_finished_spans()
             if s.name.startswith("worker.")
             and (s.attributes or {}).get("gen_ai.request.id") == "traced"]
    assert {s.name for s in spans} == {"worker.queue", "worker.prefill", "worker.decode"}
    for span in spans:
        assert format(span.context.trace_id, "032x") == trace_id
        assert span.parent is not None and format(span.parent.span_id, "016x") == parent
    others = [s for s in worker.exporter.get_finished_spans()
              if (s.attributes or {}).get("gen_ai.request.id") == "untraced"]
    assert others and all(format(s.context.trace_id, "032x") != trace_id for s in others)
