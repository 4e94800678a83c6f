"""The scheduler's provisional load: routed requests count until the worker counts them."""

from meshserve.services.scheduler.inflight import ARRIVAL_GRACE_S, Assignment, ExtraLoad, InFlight

S = 1_000_000_000  # ns per second


def routed(rid: str, at_s: float, *, sequences: int = 1, blocks: int = 4,
           epoch: int = 1) -> Assignment:
    return Assignment(rid, "w0", epoch, sequences, blocks, int(at_s * S))


def test_requests_routed_after_the_heartbeat_count_in_full() -> None:
    inflight = InFlight()
    inflight.add(routed("a", 10))
    inflight.add(routed("b", 11, sequences=2, blocks=6))
    assert inflight.extra_load("w0", 1, 5 * S, reported_sequences=0) == ExtraLoad(3, 10)


def test_a_heartbeat_counts_requests_that_arrived_but_not_those_still_on_their_way() -> None:
    inflight = InFlight()
    for i in range(4):
        inflight.add(routed(f"r{i}", 10 + i * 0.1))
    heartbeat = int(10.5 * S)  # right after the burst
    # It reports all four: none extra.
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=4) == ExtraLoad()
    # It reports 1: three are still on their way (or queued in front of it) and count.
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=1) == ExtraLoad(3, 12)
    assert inflight.release("r0", "w0")
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=0) == ExtraLoad(3, 12)
    # A heartbeat stamped ARRIVAL_GRACE_S later covers them all (released or not).
    later = int((10.3 + ARRIVAL_GRACE_S) * S)
    assert inflight.extra_load("w0", 1, later, reported_sequences=0) == ExtraLoad()
    assert len(inflight) == 0


def test_a_restarted_worker_drops_its_assignments() -> None:
    inflight = InFlight()
    inflight.add(routed("old-epoch", 10, epoch=1))
    assert inflight.extra_load("w0", 2, 0, reported_sequences=0) == ExtraLoad()
    assert len(inflight) == 0
    assert not inflight.release("old-epoch", "w0")
