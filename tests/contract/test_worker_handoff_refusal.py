"""Contract tests of a decode worker taking handed-off requests (Worker.Session, real gRPC on
127.0.0.1 over a real engine): without room for the prompt's blocks under its watermark it
answers RequestDone.refused at once, runs nothing and goes on serving; with room the same
request runs to the engine's own answer and tells the handoff where its blocks wait. The
blocks of handoffs taken and not yet admitted count as taken (of two with room for one, the
second is refused), and every way a request ends gives them back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from test_worker_session import ABORT, Session, add
from worker_harness import (
    BLOCK,
    NUM_BLOCKS,
    Harness,
    greedy,
    ref_tokens,
    reference,
    request,
    wait_idle,
)

from meshserve.proto.v1 import worker_pb2
from meshserve.services.worker.tier.handoff import RoomReservations, StoreHandoff, has_room
from meshserve.shared.sampling_params import SamplingParams

PROMPT = list(range(40, 40 + 3 * BLOCK + 5))  # three full blocks and a partial one
SOURCE = "127.0.0.1:1"


class NotingHandoff(StoreHandoff):
    """The store handoff, noting what the session tells it about expected sources."""

    def __init__(self, watermark: float) -> None:
        super().__init__(lambda timeout_s: True, BLOCK, watermark=watermark)
        self.expected: list[tuple[str, str]] = []
        self.forgotten: list[str] = []

    def expect(self, request_id: str, source: str) -> None:
        self.expected.append((request_id, source))

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def handed_off(handle: int, rid: str) -> worker_pb2.SessionAdd:
    """A decode worker's part of a request: handed off, its blocks waiting at SOURCE."""
    handed = request(rid, [PROMPT], greedy(6, ignore_eos=True))
    handed.handed_off = True
    handed.kv_source = SOURCE
    return worker_pb2.SessionAdd(handle=handle, request=handed)


def test_the_room_check_keeps_the_watermark_free() -> None:
    assert has_room(3, 10, 100, 0.0)
    assert not has_room(11, 10, 100, 0.0)
    assert has_room(3, 7, 64, 0.0625) and not has_room(3, 7, 64, 0.078125)  # 4 of 64 kept
    assert not has_room(0, 100, 100, 1.0 + 1e-9) and has_room(0, 100, 100, 1.0)


async def test_a_decode_worker_without_room_refuses_and_serves_on(worker: Harness,
                                                                  tiny_llama_dir: Path) -> None:
    handoff = NotingHandoff(watermark=1.0)  # no handoff leaves the whole cache free
    worker.servicer.handoff = handoff
    session = Session(worker)
    session.send(adds=[handed_off(1, "handed")])
    await session.until([1])
    (done,) = [d for m in session.messages for d in m.done if d.handle == 1]
    assert done.refused and not done.handed_off
    assert session.seen[1].tokens == {} and session.seen[1].error is None
    assert handoff.stats.refused == 1 and handoff.expected == []
    # The same session serves the next request (not handed off) as usual.
    session.send(adds=[add(2, "plain", [PROMPT], greedy(6, ignore_eos=True))])
    await session.until([2])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert session.seen[2].tokens[0] == ref_tokens(reference(tiny_llama_dir, PROMPT,
                                                             params)[0])
    session.half_close()


async def test_a_decode_worker_with_room_runs_the_handed_off_request(
        worker: Harness, tiny_llama_dir: Path) -> None:
    handoff = NotingHandoff(watermark=0.5)
    assert has_room(3, NUM_BLOCKS, NUM_BLOCKS, 0.5)
    worker.servicer.handoff = handoff
    session = Session(worker)
    session.send(adds=[handed_off(1, "handed")])
    await session.until([1])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert session.seen[1].tokens[0] == ref_tokens(reference(tiny_llama_dir, PROMPT,
                                                             params)[0])
    assert session.seen[1].done == 1 and handoff.stats.refused == 0
    assert handoff.expected == [("handed", SOURCE)] and handoff.forgotten == ["handed"]
    session.half_close()


def test_reservations_count_as_taken_until_released() -> None:
    room = RoomReservations()
    first, second = object(), object()
    room.reserve(first, [3, 0, 2])
    assert room.reserved == 5 and len(room) == 1
    assert has_room(3, 10, 100, 0.0) and not room.has_room(3, 7, 100, 0.0)
    room.reserve(second, [4])
    room.release(first, 2)  # its third prompt was admitted
    assert room.reserved == 7
    room.release(first, 2)  # (already released: nothing more)
    room.release(first)
    assert room.reserved == 4 and len(room) == 1
    room.release(second, 0)
    assert room.reserved == 0 and len(room) == 0
    room.release(second)  # a request that holds nothing any more releases nothing
    assert room.reserved == 0


async def test_two_handoffs_in_one_message_cannot_both_take_the_room(
        worker: Harness, tiny_llama_dir: Path) -> None:
    # 60 of 64 blocks kept free: one prompt of 3 full blocks fits (61 left), two do not (58).
    handoff = NotingHandoff(watermark=60 / NUM_BLOCKS)
    worker.servicer.handoff = handoff
    session = Session(worker)
    session.send(adds=[handed_off(1, "first"), handed_off(2, "second")])
    await session.until([1, 2])
    (refused,) = [d for m in session.messages for d in m.done if d.refused]
    assert refused.handle == 2 and session.seen[2].tokens == {}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert session.seen[1].tokens[0] == ref_tokens(reference(tiny_llama_dir, PROMPT,
                                                             params)[0])
    assert session.seen[1].error is None and handoff.stats.refused == 1
    assert handoff.expected == [("first", SOURCE)]
    reservations = worker.servicer.reservations
    assert reservations.reserved == 0 and len(reservations) == 0
    session.half_close()


async def test_an_aborted_or_disconnected_handoff_leaves_no_reservation(
        worker: Harness) -> None:
    # One sequence runs at a time: handed-off requests wait (reserved) behind a plain one
    # whose four samples of 200 tokens take hundreds of steps.
    scheduler = worker.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_seqs=1)
    # 47 of 64 blocks kept free: 3 blocks fit beside the plain request's (at most 14), 15
    # more do not.
    handoff = NotingHandoff(watermark=47 / NUM_BLOCKS)
    worker.servicer.handoff = handoff
    reservations = worker.servicer.reservations
    session = Session(worker)
    session.send(adds=[add(1, "plain", [list(range(20))], greedy(200, ignore_eos=True, n=4)),
                       handed_off(2, "waiting"), big_handoff(3, "marker")])
    await session.until([3])  # refused: request 2 was taken before it
    assert reservations.reserved == 3 and session.seen[3].tokens == {}
    session.send(aborts=[worker_pb2.SessionAbort(handle=2)])
    await session.until([2])
    assert session.seen[2].reasons == {0: ABORT} and session.seen[2].tokens[0] == []
    assert reservations.reserved == 0 and len(reservations) == 0
    session.send(adds=[handed_off(4, "disconnected"), big_handoff(5, "marker-2")])
    await session.until([5])
    assert reservations.reserved == 3
    session.call.cancel()  # the gateway goes away with both requests running or waiting
    await wait_idle(worker, within_s=10)  # the session aborted them as it closed
    assert reservations.reserved == 0 and len(reservations) == 0
    assert handoff.stats.refused == 2 and handoff.forgotten == ["waiting", "disconnected"]


def big_handoff(handle: int, rid: str) -> worker_pb2.SessionAdd:
    """A handed-off request of 15 full blocks (the marker the room check refuses)."""
    add = handed_off(handle, rid)
    del add.request.prompts[:]
    add.request.prompts.add(token_ids=list(range(100, 100 + 15 * BLOCK)))
    return add


async def test_a_handoff_past_its_deadline_on_arrival_is_forgotten(worker: Harness) -> None:
    """A handed-off request that reaches its decode worker after its deadline (the gateway
    gave up on it meanwhile) fails, and the handoff forgets where its blocks wait."""
    handoff = NotingHandoff(watermark=0.0)
    worker.servicer.handoff = handoff
    session = Session(worker)
    late = handed_off(1, "late")
    late.request.deadline_unix_ns = 1  # long past
    session.send(adds=[late])
    await session.until([1])
    error = session.seen[1].error
    assert error is not None and error.kind == "deadline_exceeded"
    assert session.seen[1].tokens == {} and handoff.stats.refused == 0
    assert handoff.forgotten == [rid for rid, _ in handoff.expected]
    reservations = worker.servicer.reservations
    assert reservations.reserved == 0 and len(reservations) == 0
    session.half_close()
