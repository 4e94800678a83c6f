"""Diagnostics: where the device's time goes between steps (with `--step-trace`).

A step's wall time on the host says how long `LLMEngine.step()` took, not why: the device
may have been busy (its kernels, or the KV tier's copies slowing them), or idle waiting for
the host to queue the next step. Timing events recorded on the engine's stream around each
step's work split it: `busy` from the start of a step's work to its end, `tier` for the KV
tier's gather queued after it, and `idle` from the end of the last work to the start of the
next (time the device had nothing queued). Events are read once the device has passed them,
so the figures of a step arrive a step or two later; summed over a run they are exact.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch


@dataclass
class DeviceTimes:
    """Seconds of device time since the last `take()`."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    tier_s: float = 0.0


class DeviceTimeline:
    """Timing events around the steps queued on the current CUDA stream."""

    def __init__(self) -> None:
        # (start, end, tier end or None) of steps whose events the device has not passed yet.
        self._queued: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event,
                                              torch.cuda.Event | None]] = collections.deque()
        self._start: torch.cuda.Event | None = None
        self._last: torch.cuda.Event | None = None  # the last event of the last step read
        self._times = DeviceTimes()

    def begin(self) -> None:
        """Before a step's first work is queued."""
        self._start = _event()

    def end(self) -> None:
        """After a step's last work (its sampling) is queued."""
        assert self._start is not None, "end() without begin()"
        self._queued.append((self._start, _event(), None))
        self._start = None

    def tier_queued(self) -> None:
        """After the KV tier's gather for the last step is queued."""
        if self._queued and self._queued[-1][2] is None:
            start, end, _ = self._queued[-1]
            self._queued[-1] = (start, end, _event())

    def take(self) -> DeviceTimes:
        """The times of the steps the device has finished since the last call."""
        while self._queued and _passed(self._queued[0]):
            start, end, tier = self._queued.popleft()
            if self._last is not None:
                self._times.idle_s += max(0.0, self._last.elapsed_time(start)) / 1e3
            self._times.busy_s += start.elapsed_time(end) / 1e3
            if tier is not None:
                self._times.tier_s += end.elapsed_time(tier) / 1e3
            self._last = tier or end
        times, self._times = self._times, DeviceTimes()
        return times


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _passed(step: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event | None]) -> bool:
    last = step[2] or step[1]
    return bool(last.query())
