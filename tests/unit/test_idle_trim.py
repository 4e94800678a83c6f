"""IdleTrim: when an idle engine hands malloc's free memory back (a fake clock and trim), and
glibc's malloc_trim reached through ctypes."""

from __future__ import annotations

from meshserve.services.worker.serving.idle_trim import IdleTrim, libc_malloc_trim


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(interval_s: float = 10.0) -> tuple[IdleTrim, Clock, list[float]]:
    clock, trims = Clock(), []
    trim = IdleTrim(interval_s, idle_s=1.0, trim=lambda: trims.append(clock.now) or 1,
                    clock=clock)
    return trim, clock, trims


def test_nothing_to_trim_until_the_engine_stepped() -> None:
    trim, _, trims = make()
    assert trim.wait_s() is None  # a fresh engine blocks for good
    assert not trim.idle()
    assert trims == []


def test_trims_once_after_the_idle_wait_then_blocks_for_good() -> None:
    trim, clock, trims = make()
    trim.busy()
    assert trim.wait_s() == 1.0
    clock.now += 1.0
    assert trim.idle()
    assert trims == [1001.0] and trim.trims == 1
    assert trim.wait_s() is None  # nothing ran since: no second trim
    assert not trim.idle()


def test_at_most_one_trim_per_interval() -> None:
    trim, clock, trims = make(interval_s=10.0)
    trim.busy()
    clock.now += 1.0
    assert trim.idle()
    clock.now += 2.0
    trim.busy()  # a short burst right after the trim
    assert trim.wait_s() == 8.0  # the rest of the interval, not the idle second
    clock.now += 5.0
    assert not trim.idle()  # woken early (by a command's race): not yet due
    clock.now += 3.0
    assert trim.idle()
    assert trims == [1001.0, 1011.0]


def test_no_trim_function_never_waits() -> None:
    trim = IdleTrim(10.0, trim=None)
    trim.busy()
    assert trim.wait_s() is None
    assert not trim.idle()


def test_glibc_malloc_trim_is_called() -> None:
    trim = libc_malloc_trim()
    assert trim is not None  # the CI image runs glibc
    garbage = [bytearray(4096) for _ in range(20_000)]  # ~80 MB freed into the arenas
    del garbage
    assert trim() in (0, 1)
