"""Contract tests of the Worker service: a real grpc.aio server on 127.0.0.1 over a real
LLMEngine on a tiny random Llama, with its KV events going to a real Redis.

References are independent of the service: the same engine class driven in-process
(step until done), the shared block hash over the prompt, and the KVIndex read back
from Redis (the session's embedded server, `redis_url` from tests/conftest_redis.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from test_worker_session import ABORT, Session, add
from worker_harness import (
    BLOCK,
    EPOCH,
    NAMESPACE,
    NUM_BLOCKS,
    PROMPTS,
    WORKER_ID,
    Harness,
    greedy,
    ref_tokens,
    reference,
    wait_idle,
)

from meshserve.proto.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.serving.registration import Registration
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.proto_errors import error_from_pb
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.status import grpc_code_for
from meshserve.shared.telemetry import metadata_with_trace

# Each test runs its requests on one Session stream (tests/contract/test_worker_session.py's
# client), the gateway's way to the worker.

LENGTH = common_pb2.FINISH_REASON_LENGTH


def done_timings(session: Session, handle: int) -> common_pb2.Timings:
    (timings,) = [d.timings for m in session.messages for d in m.done if d.handle == handle]
    return timings


async def test_generate_matches_in_process_engine(worker: Harness,
                                                  tiny_llama_dir: Path) -> None:
    session = Session(worker)
    for i, prompt in enumerate(PROMPTS):  # one at a time: each runs alone
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        expected = reference(tiny_llama_dir, prompt, params)[0]
        session.send(adds=[add(i + 1, f"g{i}", [prompt], greedy(24, ignore_eos=True))])
        await session.until([i + 1])
        seen = session.seen[i + 1]
        assert seen.tokens == {0: ref_tokens(expected)}
        assert seen.reasons == {0: LENGTH} and len(seen.tokens[0]) == 24
        assert done_timings(session, i + 1).num_steps >= 1
    assert all(m.sent_unix_ns > 0 for m in session.messages)


async def test_n2_seeded_sampling_and_logprobs_match(worker: Harness,
                                                     tiny_llama_dir: Path) -> None:
    prompt = PROMPTS[0]
    params = SamplingParams(n=2, temperature=0.8, seed=1234, max_tokens=12, logprobs=3,
                            ignore_eos=True)
    expected = reference(tiny_llama_dir, prompt, params)
    wire = common_pb2.SamplingParams(n=2, temperature=0.8, seed=1234, max_tokens=12,
                                     logprobs=3, ignore_eos=True)
    session = Session(worker)
    session.send(adds=[add(1, "n2", [prompt], wire)])
    await session.until([1])
    got = session.seen[1].tokens
    assert got == {i: ref_tokens(expected[i]) for i in (0, 1)}
    assert got[0] != got[1], "seeded siblings must differ"
    for i in (0, 1):
        want: list[TokenLogprobs] = [lp for out in expected[i] for lp in out.new_logprobs or []]
        have = session.seen[1].logprobs[i]
        assert [h.token_id for h in have] == [w.token_id for w in want] == got[i]
        assert [h.rank for h in have] == [w.rank for w in want]
        assert [list(h.top_token_ids) for h in have] == [[t for t, _ in w.top] for w in want]
        assert [h.logprob for h in have] == pytest.approx([w.logprob for w in want], abs=1e-5)
        assert all(len(h.top_token_ids) == 3 for h in have)


async def test_multiple_prompts_index_as_p_times_n(worker: Harness,
                                                   tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    session = Session(worker)
    session.send(adds=[add(1, "multi", PROMPTS[:2], common_pb2.SamplingParams(
        n=1, temperature=0.0, max_tokens=6, ignore_eos=True))])
    await session.until([1])
    expected = {p: ref_tokens(reference(tiny_llama_dir, PROMPTS[p], params)[0])
                for p in (0, 1)}
    assert session.seen[1].tokens == expected


async def test_cached_tokens_reported_on_prefix_hit(worker: Harness,
                                                    tiny_llama_dir: Path) -> None:
    prompt = PROMPTS[2]  # 40 tokens: two full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = reference(tiny_llama_dir, prompt, params, warm=prompt)[0]
    session = Session(worker)
    session.send(adds=[add(1, "first", [prompt], greedy(4))])
    await session.until([1])
    session.send(adds=[add(2, "second", [prompt], greedy(4))])
    await session.until([2])
    (first,) = [d for d in session.seen[2].details if d.HasField("cached_tokens")]
    assert first.cached_tokens == expected[-1].num_cached_tokens == 2 * BLOCK
    assert session.seen[2].tokens == {0: ref_tokens(expected)}


async def test_slow_reader_gets_coalesced_messages(worker: Harness) -> None:
    """A reader that lags behind the engine gets every token produced meanwhile in one
    message, not a backlog of one-token messages. A small HTTP/2 window (no BDP probing)
    makes the worker's writes wait for the reader, as they would on a slow network."""
    address = f"127.0.0.1:{worker.server.port}"
    async with grpc.aio.insecure_channel(address, options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]) as channel:
        session = Session(worker, stub=worker_pb2_grpc.WorkerStub(channel))
        session.send(adds=[add(1, "slow", [PROMPTS[0]],
                               greedy(120, ignore_eos=True, logprobs=20))])
        first = await session.call.read()
        assert first is not grpc.aio.EOF
        session.record(first)
        await wait_idle(worker, within_s=30)  # read nothing until the engine is done
        await session.until([1])
    sizes = [size for m in session.messages for size in m.num_tokens]
    assert sum(sizes) == 120
    assert max(sizes) > 1, f"no message carried more than one token: {sizes}"
    assert len(session.messages) < 120
    seen = session.seen[1]
    assert [lp.token_id for lp in seen.logprobs[0]] == seen.tokens[0], \
        "merged messages must keep logprobs aligned with tokens"


async def test_closing_the_session_frees_blocks_at_once(worker: Harness) -> None:
    baseline = (await worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
    assert baseline.num_free_blocks == NUM_BLOCKS
    session = Session(worker)
    session.send(adds=[add(1, "cancel-me", [PROMPTS[1]], greedy(200, ignore_eos=True))])
    await session.call.read()
    busy = (await worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
    assert busy.num_running == 1 and busy.num_free_blocks < NUM_BLOCKS
    session.call.cancel()
    load = (await wait_idle(worker, within_s=1.0)).load
    assert load.num_free_blocks == NUM_BLOCKS


async def test_abort_some_then_all_sequences(worker: Harness) -> None:
    """The Abort RPC ends sequences by request id, whichever stream carries the request."""
    wire = common_pb2.SamplingParams(n=2, temperature=0.0, max_tokens=150, ignore_eos=True)
    session = Session(worker)
    session.send(adds=[add(1, "ab", [PROMPTS[0]], wire)])
    session.record(await session.call.read())
    one = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab", indices=[1]))
    assert one.num_aborted == 1
    again = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab", indices=[1]))
    assert again.num_aborted == 0
    await session.until([1])
    assert session.seen[1].reasons == {1: ABORT, 0: LENGTH}
    assert len(session.seen[1].tokens[0]) == 150

    session.send(adds=[add(2, "ab2", [PROMPTS[0]], wire)])
    while 2 not in session.seen:  # it runs
        session.record(await session.call.read())
    both = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab2"))
    assert both.num_aborted == 2
    await session.until([2])
    assert session.seen[2].reasons == {0: ABORT, 1: ABORT}
    unknown = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="nope"))
    assert unknown.num_aborted == 0


async def test_bad_request_fails_alone(worker: Harness, tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = ref_tokens(reference(tiny_llama_dir, PROMPTS[1], params)[0])
    session = Session(worker)
    session.send(adds=[add(1, "good", [PROMPTS[1]], greedy(30, ignore_eos=True))])
    session.record(await session.call.read())
    bad_adds = [
        add(2, "bad-vocab", [[1, 2, 10**6]], greedy(4)),        # engine-side check
        add(3, "bad-len", [PROMPTS[0]], greedy(10_000)),       # context length
        add(4, "bad-param", [PROMPTS[0]], common_pb2.SamplingParams(top_p=2.0)),
        add(5, "", [PROMPTS[0]], greedy(4)),
    ]
    session.send(adds=bad_adds)
    await session.until([1, 2, 3, 4, 5])
    for bad in bad_adds:
        error = session.seen[bad.handle].error
        assert error is not None, bad.request.request_id
        assert error.kind in ("invalid_request", "context_length_exceeded")
        assert grpc_code_for(error_from_pb(error)) == grpc.StatusCode.INVALID_ARGUMENT
    assert session.seen[1].error is None
    assert session.seen[1].tokens == {0: expected}


async def test_kv_events_land_in_redis(worker: Harness) -> None:
    prompt = PROMPTS[2]
    session = Session(worker)
    session.send(adds=[add(1, "kv", [prompt], greedy(3))])
    await session.until([1])
    assert await worker.publisher.flush(timeout_s=5)
    expected = hash_blocks(prompt, BLOCK)
    assert len(expected) == 2
    held = await worker.index.blocks_of(WORKER_ID)
    assert set(expected) <= held
    assert await worker.index.epoch_of(WORKER_ID) == EPOCH
    assert await worker.index.match_prefix(expected) == {WORKER_ID: 2}


async def test_load_info_and_spans(worker: Harness) -> None:
    info = (await worker.stub.GetInfo(worker_pb2.GetInfoRequest())).info
    assert (info.worker_id, info.epoch, info.block_size, info.kv_namespace) == (
        WORKER_ID, EPOCH, BLOCK, NAMESPACE)
    assert list(info.model_names) == ["tiny"] and info.num_total_blocks == NUM_BLOCKS
    tracer = worker.telemetry.tracer
    with tracer.start_as_current_span("client") as parent:
        traceparent = dict(metadata_with_trace(None))["traceparent"]
    session = Session(worker)
    session.send(adds=[add(1, "traced", [PROMPTS[0]], greedy(5), traceparent=traceparent)])
    await session.until([1])
    context = parent.get_span_context()
    spans = {s.name: s for s in worker.exporter.get_finished_spans()
             if s.context.trace_id == context.trace_id}
    for name in ("worker.queue", "worker.prefill", "worker.decode"):
        span = spans[name]
        assert span.parent is not None and span.parent.span_id == context.span_id
        assert span.attributes["gen_ai.request.id"] == "traced"
        assert span.start_time <= span.end_time
    assert spans["worker.queue"].end_time <= spans["worker.prefill"].start_time + 1000
    assert spans["worker.prefill"].end_time <= spans["worker.decode"].start_time + 1000


async def test_engine_failure_is_fatal(worker: Harness) -> None:
    failures: list[BaseException] = []
    worker.thread.on_fatal = failures.append

    def broken_step() -> list[SequenceOutput]:
        raise RuntimeError("device lost")

    worker.engine.step = broken_step  # type: ignore[method-assign]
    session = Session(worker)
    session.send(adds=[add(1, "doomed", [PROMPTS[0]], greedy(4))])
    await session.until([1])
    error = session.seen[1].error
    assert error is not None and error.kind == "internal"
    assert "device lost" in error.message
    assert [str(f) for f in failures] == ["device lost"]
    session.send(adds=[add(2, "next", [PROMPTS[0]], greedy(4))])
    await session.until([2])
    after = session.seen[2].error
    assert after is not None and after.kind == "internal"


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records what a worker tells it; can forget the worker once (as after a restart)."""

    def __init__(self) -> None:
        self.registrations: list[scheduler_pb2.RegisterWorkerRequest] = []
        self.heartbeats: list[common_pb2.WorkerLoad] = []
        self.deregistrations: list[tuple[str, int]] = []
        self.forget_next = False
        self.changed = asyncio.Condition()

    async def _note(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def RegisterWorker(self, request: scheduler_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext
                             ) -> scheduler_pb2.RegisterWorkerResponse:
        self.registrations.append(request)
        await self._note()
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_s=0.02, ttl_s=1.0)

    async def Heartbeat(self, request: scheduler_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.HeartbeatResponse:
        self.heartbeats.append(request.load)
        registered, self.forget_next = not self.forget_next, False
        await self._note()
        return scheduler_pb2.HeartbeatResponse(registered=registered)

    async def DeregisterWorker(self, request: scheduler_pb2.DeregisterWorkerRequest,
                               context: grpc.aio.ServicerContext
                               ) -> scheduler_pb2.DeregisterWorkerResponse:
        self.deregistrations.append((request.worker_id, request.epoch))
        await self._note()
        return scheduler_pb2.DeregisterWorkerResponse(removed=True)

    async def until(self, ready: Callable[[], bool]) -> None:
        async with asyncio.timeout(10), self.changed:
            await self.changed.wait_for(ready)


async def test_registration_heartbeats_and_reregisters(worker: Harness) -> None:
    fake = FakeScheduler()
    server = GrpcServer("127.0.0.1:0", service_names=["meshserve.v1.Scheduler"])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server.server)
    port = await server.start()
    channel = GrpcClient().channel(f"127.0.0.1:{port}")
    info = (await worker.stub.GetInfo(worker_pb2.GetInfoRequest())).info

    def load() -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(worker_id=WORKER_ID, epoch=EPOCH,
                                     num_free_blocks=worker.thread.load.num_free_blocks)

    registration = Registration(scheduler_pb2_grpc.SchedulerStub(channel), lambda: info, load)
    registration.start()
    try:
        await fake.until(lambda: len(fake.heartbeats) >= 2)
        assert fake.registrations[0].info == info
        assert registration.interval_s == pytest.approx(0.02)
        assert fake.heartbeats[-1].num_free_blocks == NUM_BLOCKS
        fake.forget_next = True
        await fake.until(lambda: len(fake.registrations) == 2 and not fake.forget_next)
        await fake.until(lambda: len(fake.heartbeats) >= 4)
    finally:
        await registration.stop(deregister=True)
        await channel.close()
        await server.drain(grace_s=0.5)
    assert fake.deregistrations == [(WORKER_ID, EPOCH)]
