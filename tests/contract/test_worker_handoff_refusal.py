"""Contract tests of a decode worker taking handed-off requests (Worker.Session, real gRPC on
127.0.0.1 over a real engine): without room for the prompt's blocks under its watermark it
answers RequestDone.refused at once, runs nothing and goes on serving; with room the same
request runs to the engine's own answer and tells the handoff where its blocks wait."""

from __future__ import annotations

from pathlib import Path

from test_worker_session import Session, add
from worker_harness import BLOCK, NUM_BLOCKS, Harness, greedy, ref_tokens, reference, request

from meshserve.proto.v1 import worker_pb2
from meshserve.services.worker.tier.handoff import StoreHandoff, has_room
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
