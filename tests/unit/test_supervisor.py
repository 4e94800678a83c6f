"""The supervisor's decisions, on fake children: restart, back off, give up, declare the end."""

from __future__ import annotations

import dataclasses
import threading

from prometheus_client import generate_latest

from meshserve.local.supervisor import RestartPolicy, Supervisor


@dataclasses.dataclass
class FakeChild:
    name: str
    role: str
    code: int | None = None
    starts: int = 0
    is_ready: bool = True
    fail_start: bool = False

    @property
    def exit_code(self) -> int | None:
        return self.code

    def restart(self) -> None:
        self.starts += 1
        if self.fail_start:
            raise OSError("no such file")
        self.code = None

    def ready(self) -> bool:
        return self.is_ready

    def log_tail(self) -> str:
        return "last line"


def _supervisor(children, policy, fatal=None):
    lines: list[str] = []
    reasons: list[str] = []

    def can_serve(given_up: set[str]) -> str | None:
        left = [c for c in children if c.name not in given_up and c.role == "worker"]
        return None if left else "every worker was given up"

    sup = Supervisor(children, policy, can_serve=can_serve, say=lines.append,
                     on_fatal=(fatal or reasons.append))
    return sup, lines, reasons


def _tick(sup: Supervisor, now: float) -> None:
    for state in sup._states.values():
        sup._watch(state, now)


def test_a_dead_child_is_restarted_after_a_doubling_backoff() -> None:
    child = FakeChild("worker-0", "worker")
    sup, lines, reasons = _supervisor([child, FakeChild("worker-1", "worker")],
                                      RestartPolicy(budget=5, initial_backoff_s=0.5,
                                                    stable_s=60))
    child.code = -9
    _tick(sup, 1.0)
    assert "worker-0 was killed by signal 9; restarting it in 0.5s" in lines[-1]
    _tick(sup, 1.4)
    assert child.starts == 0  # still backing off
    _tick(sup, 1.5)
    assert child.starts == 1 and sup.restarts("worker-0") == 1
    _tick(sup, 1.6)
    assert lines[-1].startswith("worker-0 is back, 0.6s after it died")
    child.code = 1  # dies again soon: the backoff doubles
    _tick(sup, 2.0)
    assert "restarting it in 1s" in lines[-1]
    _tick(sup, 3.0)
    assert child.starts == 2
    child.code = 1
    _tick(sup, 3.0 + 61)  # after a minute up, the backoff starts over
    assert "restarting it in 0.5s" in lines[-1]
    metrics = generate_latest(sup.registry).decode()
    assert 'meshserve:launcher_service_restarts_total{role="worker",service="worker-0"} 2.0' \
        in metrics
    assert 'meshserve:launcher_service_up{role="worker",service="worker-0"} 0.0' in metrics
    assert reasons == []


def test_past_its_budget_a_child_is_given_up_and_the_rest_keeps_serving() -> None:
    w0, w1 = FakeChild("worker-0", "worker"), FakeChild("worker-1", "worker")
    sup, lines, reasons = _supervisor([w0, w1], RestartPolicy(budget=1, window_s=100))
    w0.code = -9
    _tick(sup, 0.0)
    _tick(sup, 0.5)
    assert w0.starts == 1
    w0.code = -9
    _tick(sup, 1.0)
    assert "given up" in lines[-1] and sup.given_up() == {"worker-0"}
    assert reasons == []  # worker-1 still serves
    assert 'meshserve:launcher_service_given_up{role="worker",service="worker-0"} 1.0' in \
        generate_latest(sup.registry).decode()
    w1.code = -9
    _tick(sup, 2.0)
    _tick(sup, 2.5)
    w1.code = -9
    _tick(sup, 3.0)
    assert reasons == ["every worker was given up"]


def test_restarts_older_than_the_window_no_longer_count() -> None:
    child = FakeChild("kvstore", "kvstore")
    sup, _, _ = _supervisor([child, FakeChild("worker-0", "worker")],
                            RestartPolicy(budget=1, window_s=10))
    child.code = 1
    _tick(sup, 0.0)
    _tick(sup, 0.5)
    child.code = 1
    _tick(sup, 20.0)  # the first restart is out of the window
    assert sup.given_up() == set()
    _tick(sup, 30.0)
    assert child.starts == 2


def test_a_start_that_fails_is_one_more_death() -> None:
    child = FakeChild("scheduler", "scheduler", fail_start=True)
    sup, lines, _ = _supervisor([child, FakeChild("worker-0", "worker")],
                                RestartPolicy(budget=2))
    child.code = 1
    _tick(sup, 0.0)
    _tick(sup, 0.5)
    assert "could not be started again (no such file)" in lines[-1]
    _tick(sup, 1.5)
    assert "given up" in lines[-1]


def test_with_a_budget_of_zero_any_death_ends_the_stack() -> None:
    child = FakeChild("kvstore", "kvstore")
    sup, _, reasons = _supervisor([child, FakeChild("worker-0", "worker")],
                                  RestartPolicy(budget=0))
    child.code = 3
    _tick(sup, 0.0)
    assert reasons == ["kvstore exited with code 3 (--restart-budget 0)"]
    assert child.starts == 0


def test_the_thread_restarts_and_stops_when_told() -> None:
    child = FakeChild("worker-0", "worker")
    restarted = threading.Event()

    def say(line: str) -> None:
        if "started again" in line:
            restarted.set()

    sup = Supervisor([child], RestartPolicy(initial_backoff_s=0.01), can_serve=lambda _: None,
                     say=say, on_fatal=lambda _: None)
    sup.start()
    child.code = -15
    assert restarted.wait(10)
    sup.stop()
    child.code = -15  # dies while the stack stops: not restarted
    sup.finish()
    assert child.starts == 1
