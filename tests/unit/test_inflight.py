"""The scheduler's provisional load: routed requests count until released, never twice."""

from meshserve.services.scheduler.inflight import MAX_AGE_S, Assignment, ExtraLoad, InFlight

S = 1_000_000_000  # ns per second


def routed(rid: str, at_s: float, *, sequences: int = 1, blocks: int = 4,
           epoch: int = 1) -> Assignment:
    return Assignment(rid, "w0", epoch, sequences, blocks, int(at_s * S))


def test_requests_routed_after_the_heartbeat_count_in_full() -> None:
    inflight = InFlight()
    inflight.add(routed("a", 10))
    inflight.add(routed("b", 11, sequences=2, blocks=6))
    assert inflight.extra_load("w0", 1, 5 * S, reported_sequences=0, now_unix_ns=12 * S) == \
        ExtraLoad(3, 10)


def test_a_heartbeat_counts_requests_that_arrived_but_not_those_still_on_their_way() -> None:
    inflight = InFlight()
    for i in range(4):
        inflight.add(routed(f"r{i}", 10 + i))
    # The worker's heartbeat at 20 s reports 4 sequences: all four arrived, none extra.
    assert inflight.extra_load("w0", 1, 20 * S, reported_sequences=4,
                               now_unix_ns=21 * S) == ExtraLoad()
    # It reports 1: three are still on their way (or queued in front of it) and count.
    assert inflight.extra_load("w0", 1, 20 * S, reported_sequences=1,
                               now_unix_ns=21 * S) == ExtraLoad(3, 12)
    # They stay counted until released, heartbeat after heartbeat.
    for i in range(3):
        assert inflight.release(f"r{i}", "w0")
    assert inflight.extra_load("w0", 1, 30 * S, reported_sequences=0,
                               now_unix_ns=31 * S) == ExtraLoad(1, 4)


def test_a_restarted_worker_or_a_lost_release_drops_the_assignment() -> None:
    inflight = InFlight()
    inflight.add(routed("old-epoch", 10, epoch=1))
    assert inflight.extra_load("w0", 2, 0, reported_sequences=0, now_unix_ns=11 * S) == \
        ExtraLoad()
    assert len(inflight) == 0
    inflight.add(routed("lost", 10, epoch=2))
    later = int((10 + MAX_AGE_S + 1) * S)
    assert inflight.extra_load("w0", 2, 0, reported_sequences=0, now_unix_ns=later) == \
        ExtraLoad()
    assert not inflight.release("lost", "w0")
