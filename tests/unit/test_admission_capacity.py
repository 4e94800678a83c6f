"""Unit tests of admission by capacity: the wait estimate behind refusals
(scheduler/wait_estimate.py), the global queue's `admit` hook that applies it, and the
gateway's side (its ceiling, refusals counted by reason, Retry-After)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter
from test_global_queue import Slots, enqueue

from meshserve.services.gateway.api.middleware import retry_after_of
from meshserve.services.gateway.flow.admission import Admission
from meshserve.services.scheduler.inflight import Assignment, InFlight
from meshserve.services.scheduler.queue import GlobalQueue
from meshserve.services.scheduler.wait_estimate import WaitEstimator, retry_after
from meshserve.shared.errors import OverloadedError, UnavailableError
from meshserve.shared.proto_errors import error_from_pb, error_pb


def test_no_estimate_before_a_release_or_with_nothing_in_service() -> None:
    waits = WaitEstimator()
    assert waits.estimate(ahead=100, in_service=8) is None
    assert waits.refusal(ahead=10_000, in_service=8, bound_s=0.001) is None
    waits.observe(2.0)
    assert waits.estimate(ahead=100, in_service=0) is None


def test_before_a_release_the_age_in_service_is_the_service_time() -> None:
    waits = WaitEstimator()
    # 4 requests in service for 30 s on average, none ended: each takes 30 s at least.
    assert waits.estimate(ahead=3, in_service=4, age_s=30.0) == pytest.approx(30.0)
    error = waits.refusal(ahead=3, in_service=4, bound_s=20.0, age_s=30.0)
    assert error is not None and error.retry_after_s == 10
    assert waits.estimate(ahead=3, in_service=4, age_s=0.0) is None  # a burst just routed
    waits.observe(2.0)  # once requests end, their times count instead
    assert waits.estimate(ahead=3, in_service=4, age_s=30.0) == pytest.approx(2.0)


def test_wait_is_the_departures_ahead_over_the_service_rate() -> None:
    waits = WaitEstimator()
    waits.observe(4.0)  # 8 in service, 4 s each: 2 leave a second
    assert waits.estimate(ahead=0, in_service=8) == pytest.approx(0.5)
    assert waits.estimate(ahead=9, in_service=8) == pytest.approx(5.0)
    # Twice the requests in service at the same service time: twice the rate.
    assert waits.estimate(ahead=9, in_service=16) == pytest.approx(2.5)


def test_service_time_is_a_moving_average_of_releases() -> None:
    waits = WaitEstimator(smoothing=0.5)
    waits.observe(2.0)
    assert waits.service_s == pytest.approx(2.0)
    waits.observe(4.0)
    assert waits.service_s == pytest.approx(3.0)
    waits.observe(-1.0)  # a clock step back counts as an instant release, not negative
    assert waits.service_s == pytest.approx(1.5)
    for _ in range(60):  # the rate follows a lasting change
        waits.observe(10.0)
    assert waits.service_s == pytest.approx(10.0, rel=1e-6)


def test_refusal_past_the_bound_with_retry_after_from_the_estimate() -> None:
    waits = WaitEstimator()
    waits.observe(4.0)
    assert waits.refusal(ahead=9, in_service=8, bound_s=5.0) is None  # exactly at the bound
    error = waits.refusal(ahead=29, in_service=8, bound_s=5.0)  # 15 s
    assert isinstance(error, OverloadedError)
    assert error.reason == "queue_delay"
    assert error.retry_after_s == 10  # the queue drains to the bound in 10 s
    assert "15.0s" in error.message and "29 requests" in error.message
    # A near deadline is a bound like any other: 0.5 s left refuses a 1 s wait.
    assert waits.refusal(ahead=1, in_service=8, bound_s=0.5) is not None


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    assert retry_after(5.01, 5.0) == 1
    assert retry_after(7.2, 5.0) == 3
    assert retry_after(65.0, 60.0) == 5


def test_overloaded_error_keeps_retry_after_and_reason_on_the_wire() -> None:
    error = error_from_pb(error_pb(OverloadedError("full", retry_after_s=7,
                                                   reason="queue_delay")))
    assert isinstance(error, OverloadedError)
    assert (error.message, error.retry_after_s, error.reason) == ("full", 7, "queue_delay")
    plain = error_from_pb(error_pb(OverloadedError("full")))
    assert isinstance(plain, OverloadedError)
    assert (plain.retry_after_s, plain.reason) == (None, "")


def _assignment(request_id: str, worker_id: str, routed: int, epoch: int = 1) -> Assignment:
    return Assignment(request_id, worker_id, epoch=epoch, num_sequences=1, num_blocks=2,
                      routed_unix_ns=routed)


def test_inflight_release_returns_the_assignment_once() -> None:
    inflight = InFlight()
    inflight.add(_assignment("r1", "w0", 5_000))
    released = inflight.release("r1", "w0", 9_000)
    assert released is not None and released.routed_unix_ns == 5_000
    assert inflight.release("r1", "w0", 9_500) is None
    assert len(inflight) == 0 and inflight.mean_routed_unix_ns() is None


def test_inflight_count_and_mean_routing_time_follow_every_change() -> None:
    inflight = InFlight()
    for rid, worker, routed in [("a", "w0", 1_000), ("b", "w0", 3_000), ("c", "w1", 5_000)]:
        inflight.add(_assignment(rid, worker, routed))
    assert len(inflight) == 3 and inflight.mean_routed_unix_ns() == 3_000
    inflight.add(_assignment("b", "w0", 6_000))  # the same request again replaces it
    assert len(inflight) == 3 and inflight.mean_routed_unix_ns() == 4_000
    inflight.release("a", "w0", 7_000)
    assert len(inflight) == 2 and inflight.mean_routed_unix_ns() == 5_500
    inflight.keep_only({"w0"})  # w1 left the registry
    assert len(inflight) == 1 and inflight.mean_routed_unix_ns() == 6_000
    inflight.extra_load("w0", epoch=2, last_heartbeat_unix_ns=8_000, reported_sequences=0)
    assert len(inflight) == 0  # w0 restarted: its old epoch's request is forgotten


async def test_queue_admit_sees_the_requests_ahead_and_refuses_before_queueing() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots()
    waiting = [await enqueue(queue, slots, f"q{i}") for i in range(3)]
    seen: list[int] = []

    def admit(ahead: int) -> None:
        seen.append(ahead)
        if ahead >= 3:
            raise OverloadedError("too long", retry_after_s=2, reason="queue_delay")

    with pytest.raises(OverloadedError) as refused:
        await queue.run(slots.attempt_for("late"), admit=admit)
    assert refused.value.reason == "queue_delay" and seen == [3]
    assert len(queue) == 3  # the refused request never joined
    slots.free = 3
    queue.notify()
    assert await asyncio.gather(*waiting) == ["q0", "q1", "q2"]


async def test_queue_admit_is_not_asked_when_the_request_is_placed_at_once() -> None:
    queue, slots = GlobalQueue(capacity=10), Slots(free=1)

    def admit(ahead: int) -> None:
        raise AssertionError("admit asked for a request that found room")

    assert await queue.run(slots.attempt_for("a"), admit=admit) == "a"


async def test_a_full_queue_says_so_in_its_reason() -> None:
    queue, slots = GlobalQueue(capacity=0), Slots()
    with pytest.raises(OverloadedError) as refused:
        await queue.run(slots.attempt_for("a"))
    assert refused.value.reason == "queue_full"


def test_the_gateway_ceiling_refuses_and_counts_by_reason() -> None:
    registry = CollectorRegistry()
    refusals = Counter("refusals", "by reason", ["reason"], registry=registry)
    admission = Admission(1, refusals=refusals)
    with admission.slot():
        with pytest.raises(OverloadedError) as refused, admission.slot():
            pass
        assert refused.value.reason == "ceiling" and refused.value.retry_after_s is None
    # A refusal by the scheduler's estimate, raised inside an admitted slot, is counted too.
    with pytest.raises(OverloadedError), admission.slot():
        raise OverloadedError("wait too long", retry_after_s=3, reason="queue_delay")
    assert admission.in_flight == 0
    assert registry.get_sample_value("refusals_total", {"reason": "ceiling"}) == 1
    assert registry.get_sample_value("refusals_total", {"reason": "queue_delay"}) == 1


def test_retry_after_of_an_answer_prefers_the_refusals_estimate() -> None:
    assert retry_after_of(OverloadedError("x", retry_after_s=9), 1) == 9
    assert retry_after_of(OverloadedError("x"), 1) == 1
    assert retry_after_of(UnavailableError("down"), 2) == 2
