"""Contract tests of the Worker service: a real grpc.aio server on 127.0.0.1 over a real
LLMEngine on a tiny random Llama, with its KV events going to a real Redis.

References are independent of the service: the same engine class driven in-process
(step until done), the shared block hash over the prompt, and the KVIndex read back
from Redis (the session's embedded server, `redis_url` from tests/conftest_redis.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from opentelemetry.trace import SpanKind
from worker_harness import (
    BLOCK,
    EPOCH,
    NAMESPACE,
    NUM_BLOCKS,
    PROMPTS,
    WORKER_ID,
    Harness,
    collect,
    greedy,
    ref_tokens,
    reference,
    request,
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
from meshserve.services.worker.registration import Registration
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.grpc_client import GrpcClient
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.status import ERROR_KIND_KEY
from meshserve.shared.telemetry import metadata_with_trace


def tokens_by_index(messages: list[worker_pb2.GenerateResponse]) -> dict[int, list[int]]:
    result: dict[int, list[int]] = {}
    for message in messages:
        for out in message.outputs:
            result.setdefault(out.index, []).extend(out.token_ids)
    return result


def final(messages: list[worker_pb2.GenerateResponse], index: int) -> worker_pb2.SequenceOutput:
    finished = [o for m in messages for o in m.outputs
                if o.index == index and o.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert len(finished) == 1, f"sequence {index} finished {len(finished)} times"
    return finished[0]


async def test_generate_matches_in_process_engine(worker: Harness,
                                                  tiny_llama_dir: Path) -> None:
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        expected = reference(tiny_llama_dir, prompt, params)[0]
        messages = await collect(worker.stub.Generate(request(f"g{i}", [prompt],
                                                              greedy(24, ignore_eos=True))))
        assert tokens_by_index(messages) == {0: ref_tokens(expected)}
        last = final(messages, 0)
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 24)
        assert all(m.timings.sent_unix_ns > 0 for m in messages)
        assert messages[-1].timings.num_steps >= 1


async def test_n2_seeded_sampling_and_logprobs_match(worker: Harness,
                                                     tiny_llama_dir: Path) -> None:
    prompt = PROMPTS[0]
    params = SamplingParams(n=2, temperature=0.8, seed=1234, max_tokens=12, logprobs=3,
                            ignore_eos=True)
    expected = reference(tiny_llama_dir, prompt, params)
    wire = common_pb2.SamplingParams(n=2, temperature=0.8, seed=1234, max_tokens=12,
                                     logprobs=3, ignore_eos=True)
    messages = await collect(worker.stub.Generate(request("n2", [prompt], wire)))
    got = tokens_by_index(messages)
    assert got == {i: ref_tokens(expected[i]) for i in (0, 1)}
    assert got[0] != got[1], "seeded siblings must differ"
    for i in (0, 1):
        want: list[TokenLogprobs] = [lp for out in expected[i] for lp in out.new_logprobs or []]
        have = [lp for m in messages for o in m.outputs if o.index == i for lp in o.logprobs]
        assert [h.token_id for h in have] == [w.token_id for w in want] == got[i]
        assert [h.rank for h in have] == [w.rank for w in want]
        assert [list(h.top_token_ids) for h in have] == [[t for t, _ in w.top] for w in want]
        assert [h.logprob for h in have] == pytest.approx([w.logprob for w in want], abs=1e-5)
        assert all(len(h.top_token_ids) == 3 for h in have)


async def test_multiple_prompts_index_as_p_times_n(worker: Harness,
                                                   tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    messages = await collect(worker.stub.Generate(request(
        "multi", PROMPTS[:2], common_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=6,
                                                        ignore_eos=True))))
    expected = {p: ref_tokens(reference(tiny_llama_dir, PROMPTS[p], params)[0])
                for p in (0, 1)}
    assert tokens_by_index(messages) == expected


async def test_cached_tokens_reported_on_prefix_hit(worker: Harness,
                                                    tiny_llama_dir: Path) -> None:
    prompt = PROMPTS[2]  # 40 tokens: two full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = reference(tiny_llama_dir, prompt, params, warm=prompt)[0]
    await collect(worker.stub.Generate(request("first", [prompt], greedy(4))))
    messages = await collect(worker.stub.Generate(request("second", [prompt], greedy(4))))
    usage = final(messages, 0).usage
    assert usage.cached_tokens == expected[-1].num_cached_tokens == 2 * BLOCK
    assert tokens_by_index(messages) == {0: ref_tokens(expected)}


async def test_slow_reader_gets_coalesced_messages(worker: Harness) -> None:
    """A reader that lags behind the engine gets every token produced meanwhile in one
    message, not a backlog of one-token messages. A small HTTP/2 window (no BDP probing)
    makes the worker's writes wait for the reader, as they would on a slow network."""
    address = f"127.0.0.1:{worker.server.port}"
    async with grpc.aio.insecure_channel(address, options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate(
            request("slow", [PROMPTS[0]], greedy(120, ignore_eos=True, logprobs=20)))
        first = await call.read()
        await wait_idle(worker, within_s=30)  # read nothing until the engine is done
        messages = [first, *await collect(call)]
    sizes = [len(o.token_ids) for m in messages for o in m.outputs]
    assert sum(sizes) == 120
    assert max(sizes) > 1, f"no message carried more than one token: {sizes}"
    assert len(messages) < 120
    tokens = [t for m in messages for o in m.outputs for t in o.token_ids]
    logprob_ids = [lp.token_id for m in messages for o in m.outputs for lp in o.logprobs]
    assert logprob_ids == tokens, "merged messages must keep logprobs aligned with tokens"


async def test_cancel_frees_blocks_at_once(worker: Harness) -> None:
    baseline = (await worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
    assert baseline.num_free_blocks == NUM_BLOCKS
    call = worker.stub.Generate(request("cancel-me", [PROMPTS[1]],
                                        greedy(200, ignore_eos=True)))
    await call.read()
    busy = (await worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
    assert busy.num_running == 1 and busy.num_free_blocks < NUM_BLOCKS
    call.cancel()
    load = (await wait_idle(worker, within_s=1.0)).load
    assert load.num_free_blocks == NUM_BLOCKS
    aborted = worker.telemetry.registry.get_sample_value(
        "meshserve:worker_sequences_finished_total", {"finish_reason": "abort"})
    assert aborted == 1


async def test_abort_some_then_all_sequences(worker: Harness) -> None:
    wire = common_pb2.SamplingParams(n=2, temperature=0.0, max_tokens=150, ignore_eos=True)
    call = worker.stub.Generate(request("ab", [PROMPTS[0]], wire))
    await call.read()
    one = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab", indices=[1]))
    assert one.num_aborted == 1
    again = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab", indices=[1]))
    assert again.num_aborted == 0
    rest = await collect(call)
    assert final(rest, 1).finish_reason == common_pb2.FINISH_REASON_ABORT
    assert final(rest, 0).finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final(rest, 0).usage.completion_tokens == 150

    call = worker.stub.Generate(request("ab2", [PROMPTS[0]], wire))
    await call.read()
    both = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab2"))
    assert both.num_aborted == 2
    rest = await collect(call)
    assert {final(rest, i).finish_reason for i in (0, 1)} == {common_pb2.FINISH_REASON_ABORT}
    unknown = await worker.stub.Abort(worker_pb2.AbortRequest(request_id="nope"))
    assert unknown.num_aborted == 0


async def test_bad_request_fails_alone(worker: Harness, tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = ref_tokens(reference(tiny_llama_dir, PROMPTS[1], params)[0])
    good = worker.stub.Generate(request("good", [PROMPTS[1]], greedy(30, ignore_eos=True)))
    first = await good.read()
    bad_calls = [
        request("bad-vocab", [[1, 2, 10**6]], greedy(4)),        # engine-side check
        request("bad-len", [PROMPTS[0]], greedy(10_000)),       # context length
        request("bad-param", [PROMPTS[0]], common_pb2.SamplingParams(top_p=2.0)),
        request("", [PROMPTS[0]], greedy(4)),
    ]
    for bad in bad_calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(worker.stub.Generate(bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.request_id
        kinds = dict(info.value.trailing_metadata() or ())
        assert kinds[ERROR_KIND_KEY] in ("invalid_request", "context_length_exceeded")
    rest = await collect(good)
    assert tokens_by_index([first, *rest]) == {0: expected}


async def test_kv_events_land_in_redis(worker: Harness) -> None:
    prompt = PROMPTS[2]
    await collect(worker.stub.Generate(request("kv", [prompt], greedy(3))))
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
        metadata = metadata_with_trace(None)
        await collect(worker.stub.Generate(request("traced", [PROMPTS[0]], greedy(5)),
                                           metadata=metadata))
    trace_id = parent.get_span_context().trace_id
    spans = {s.name: s for s in worker.exporter.get_finished_spans()
             if s.context.trace_id == trace_id}
    server = spans["meshserve.v1.Worker/Generate"]
    assert server.kind == SpanKind.SERVER
    for name in ("worker.queue", "worker.prefill", "worker.decode"):
        span = spans[name]
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert span.attributes["gen_ai.request.id"] == "traced"
        assert span.start_time <= span.end_time
    assert spans["worker.queue"].end_time <= spans["worker.prefill"].start_time + 1000
    assert spans["worker.prefill"].end_time <= spans["worker.decode"].start_time + 1000


async def test_deadline_aborts_the_request(worker: Harness) -> None:
    call = worker.stub.Generate(worker_pb2.GenerateRequest(
        request_id="late", prompts=[worker_pb2.Prompt(token_ids=PROMPTS[1])],
        params=greedy(200, ignore_eos=True), deadline_unix_ns=time.time_ns() + 50_000_000))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    load = (await wait_idle(worker, within_s=1.0)).load
    assert load.num_free_blocks == NUM_BLOCKS


async def test_engine_failure_is_fatal(worker: Harness) -> None:
    failures: list[BaseException] = []
    worker.thread.on_fatal = failures.append

    def broken_step() -> list[SequenceOutput]:
        raise RuntimeError("device lost")

    worker.engine.step = broken_step  # type: ignore[method-assign]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(worker.stub.Generate(request("doomed", [PROMPTS[0]], greedy(4))))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "device lost" in (info.value.details() or "")
    assert [str(f) for f in failures] == ["device lost"]
    with pytest.raises(grpc.aio.AioRpcError) as after:
        await collect(worker.stub.Generate(request("next", [PROMPTS[0]], greedy(4))))
    assert after.value.code() == grpc.StatusCode.INTERNAL


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
