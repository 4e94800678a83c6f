"""The scheduler's provisional load: routed requests count until the worker counts them,
released ones stop counting before the worker's next heartbeat says so."""

from meshserve.services.scheduler.inflight import (
    ARRIVAL_GRACE_S,
    MAX_TRACK_S,
    Assignment,
    ExtraLoad,
    InFlight,
)

S = 1_000_000_000  # ns per second


def routed(rid: str, at_s: float, *, sequences: int = 1, blocks: int = 4, active: int = 0,
           epoch: int = 1) -> Assignment:
    return Assignment(rid, "w0", epoch, sequences, blocks, int(at_s * S), active)


def test_requests_routed_after_the_heartbeat_count_in_full() -> None:
    inflight = InFlight()
    inflight.add(routed("a", 10, active=130))
    inflight.add(routed("b", 11, sequences=2, blocks=6, active=260))
    assert inflight.extra_load("w0", 1, 5 * S, reported_sequences=0) == ExtraLoad(3, 10, 390)


def test_a_heartbeat_counts_requests_that_arrived_but_not_those_still_on_their_way() -> None:
    inflight = InFlight()
    for i in range(4):
        inflight.add(routed(f"r{i}", 10 + i * 0.1, active=10))
    heartbeat = int(10.5 * S)  # right after the burst
    # It reports all four: none extra.
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=4) == ExtraLoad()
    # It reports 1: three are still on their way (or queued in front of it) and count.
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=1) == \
        ExtraLoad(3, 12, 30)
    # A heartbeat stamped ARRIVAL_GRACE_S later covers them all: nothing extra, although
    # they stay tracked until released.
    later = int((10.3 + ARRIVAL_GRACE_S) * S)
    assert inflight.extra_load("w0", 1, later, reported_sequences=0) == ExtraLoad()
    assert len(inflight) == 4


def test_a_release_after_the_heartbeat_takes_the_request_off_its_reported_load() -> None:
    inflight = InFlight()
    inflight.add(routed("old", 10, blocks=6, active=130))
    inflight.add(routed("new", 21, blocks=6, active=130))
    heartbeat = 20 * S  # counted "old" (running), not "new" (routed after it)
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=1) == \
        ExtraLoad(1, 6, 130)
    # Both end before the next heartbeat: "old" leaves the reported load, "new" its extra.
    assert inflight.release("old", "w0", 21 * S) and inflight.release("new", "w0", 22 * S)
    assert inflight.extra_load("w0", 1, heartbeat, reported_sequences=1) == \
        ExtraLoad(-1, -6, -130)
    assert len(inflight) == 0
    # The next heartbeat shows the departure itself: no correction any more.
    assert inflight.extra_load("w0", 1, 23 * S, reported_sequences=0) == ExtraLoad()
    assert not inflight.release("old", "w0", 24 * S)  # released once only


def test_a_request_never_released_is_forgotten_after_max_track_s() -> None:
    inflight = InFlight()
    inflight.add(routed("lost", 10))
    assert len(inflight) == 1
    inflight.extra_load("w0", 1, int((10 + MAX_TRACK_S + 1) * S), reported_sequences=0)
    assert len(inflight) == 0


def test_a_restarted_worker_drops_its_assignments_and_departures() -> None:
    inflight = InFlight()
    inflight.add(routed("old-epoch", 10, epoch=1))
    inflight.add(routed("gone", 10, epoch=1))
    assert inflight.release("gone", "w0", 12 * S)
    assert inflight.extra_load("w0", 2, 11 * S, reported_sequences=0) == ExtraLoad()
    assert len(inflight) == 0
    assert not inflight.release("old-epoch", "w0", 12 * S)


def test_workers_that_left_are_forgotten() -> None:
    inflight = InFlight()
    inflight.add(routed("a", 10))
    inflight.keep_only({"w1"})
    assert len(inflight) == 0
    assert inflight.extra_load("w0", 1, 5 * S, reported_sequences=0) == ExtraLoad()
