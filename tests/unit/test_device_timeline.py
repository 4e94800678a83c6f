"""DeviceTimeline's split of device time (busy, idle, KV tier), with stand-in events on a
clock the test moves (CUDA timing events need a GPU; their arithmetic does not)."""

from __future__ import annotations

import pytest

from meshserve.services.worker.engine import device_timeline
from meshserve.services.worker.engine.device_timeline import DeviceTimeline
from meshserve.services.worker.serving.step_trace import device_fields


class _Device:
    """When the device reaches each event: set by the test; None until it has."""

    def __init__(self) -> None:
        self.events: list[_Event] = []


class _Event:
    def __init__(self, device: _Device) -> None:
        self.at_ms: float | None = None
        device.events.append(self)

    def query(self) -> bool:
        return self.at_ms is not None

    def elapsed_time(self, later: _Event) -> float:
        assert self.at_ms is not None and later.at_ms is not None, "event not reached"
        return later.at_ms - self.at_ms


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> _Device:
    fake = _Device()
    monkeypatch.setattr(device_timeline, "_event", lambda: _Event(fake))
    return fake


def _reach(device: _Device, *times_ms: float) -> None:
    pending = [event for event in device.events if event.at_ms is None]
    for event, at_ms in zip(pending, times_ms, strict=False):
        event.at_ms = at_ms


def test_busy_idle_and_tier_are_split_and_read_once_passed(device: _Device) -> None:
    timeline = DeviceTimeline()
    timeline.begin()
    timeline.end()
    timeline.tier_queued()  # step 1: work 0-10 ms, gather 10-12 ms
    timeline.begin()
    timeline.end()  # step 2: starts 15 ms (idle 3 ms after the gather), ends 40 ms
    _reach(device, 0.0, 10.0, 12.0)
    first = timeline.take()
    assert (first.busy_s, first.idle_s, first.tier_s) == pytest.approx((0.010, 0.0, 0.002))
    assert timeline.take() == device_timeline.DeviceTimes()  # step 2 is not finished yet
    _reach(device, 15.0, 40.0)
    second = timeline.take()
    assert (second.busy_s, second.idle_s, second.tier_s) == pytest.approx((0.025, 0.003, 0.0))


def test_a_gather_is_only_counted_once_and_only_after_a_step(device: _Device) -> None:
    timeline = DeviceTimeline()
    timeline.tier_queued()  # no step queued yet: nothing to attach it to
    assert device.events == []
    timeline.begin()
    timeline.end()
    timeline.tier_queued()
    timeline.tier_queued()  # a second gather marker for the same step is ignored
    assert len(device.events) == 3
    _reach(device, 0.0, 4.0, 5.0)
    times = timeline.take()
    assert (times.busy_s, times.tier_s) == pytest.approx((0.004, 0.001))


def test_end_without_begin_is_a_bug(device: _Device) -> None:
    with pytest.raises(AssertionError, match="without begin"):
        DeviceTimeline().end()


def test_step_records_carry_device_time_only_when_timed() -> None:
    class _Engine:
        timeline: DeviceTimeline | None = None

    assert device_fields(_Engine()) == {}
