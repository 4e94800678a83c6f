"""Supervision of `meshserve up`'s children: what dies on its own is started again.

    supervisor = Supervisor(children, policy, can_serve=..., say=print, on_fatal=...)
    supervisor.start()        # a daemon thread; polls the children every 50 ms
    ...
    supervisor.stop()         # before the stack stops its children on purpose
    ...                       # (stop them)
    supervisor.finish()       # then let its thread end

A child (a service process, or the embedded Redis) that exits while the stack is not
stopping is restarted with the same command, address and ports, so that its peers find it
again where it was, after a backoff (0.5 s doubling to 10 s; back to 0.5 s once a child has
stayed up for `stable_s`) and within a budget (`budget` restarts in `window_s` per child;
past it the child is given up). Each death, restart and recovery is logged with the time it
took and counted in Prometheus metrics. Giving a child up stops the stack only when what is
left cannot serve (`can_serve` says, by role: no gateway, no worker, no tokenizer, or no
scheduler); a dead worker only takes its own capacity away.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

_POLL_S = 0.05


class Child(Protocol):
    """What the supervisor needs of a child process."""

    name: str
    role: str

    @property
    def exit_code(self) -> int | None: ...  # None while it runs
    def restart(self) -> None: ...  # start it again, the same way
    def ready(self) -> bool: ...  # its readiness check, right now
    def log_tail(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How often and how soon a dead child is started again."""

    budget: int = 5  # restarts per window; 0: never restart (a death stops the stack)
    window_s: float = 300.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_s: float = 60.0  # up this long: the next death starts from initial_backoff_s


@dataclasses.dataclass
class _State:
    """The supervisor's book on one child."""

    child: Child
    started_at: float
    restarts: collections.deque[float] = dataclasses.field(default_factory=collections.deque)
    backoff_s: float = 0.0
    restart_at: float | None = None  # dead, to be started again at this time
    died_at: float | None = None  # dead (or restarted and not yet ready) since
    given_up: bool = False
    num_restarts: int = 0  # in all (`restarts` holds those of the window only)


def exit_description(code: int) -> str:
    """'exited with code 1' or 'was killed by signal 9'."""
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class Supervisor:
    """Watches children from a thread of its own; restarts, gives up, or declares the end."""

    def __init__(self, children: Sequence[Child], policy: RestartPolicy, *,
                 can_serve: Callable[[set[str]], str | None],
                 say: Callable[[str], None], on_fatal: Callable[[str], None],
                 registry: CollectorRegistry | None = None) -> None:
        """`can_serve(given_up_names)` returns why the stack cannot serve, or None.
        `on_fatal(reason)` is called once, from the supervisor's thread, when a death
        cannot be restarted and the rest cannot serve."""
        now = time.monotonic()
        self._states = {c.name: _State(c, now) for c in children}
        self._policy = policy
        self._can_serve = can_serve
        self._say = say
        self._on_fatal = on_fatal
        self._stopping = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshserve-supervisor",
                                        daemon=True)
        self.registry = registry or CollectorRegistry()
        labels = ["service", "role"]
        self._restarts = Counter("meshserve:launcher_service_restarts",
                                 "Times a service was started again after it died", labels,
                                 registry=self.registry)
        self._up = Gauge("meshserve:launcher_service_up",
                         "1 while the service runs and answers its readiness check", labels,
                         registry=self.registry)
        self._given_up = Gauge("meshserve:launcher_service_given_up",
                               "1 once the service died more often than its restart budget",
                               labels, registry=self.registry)
        for child in children:
            self._up.labels(child.name, child.role).set(1)
            self._given_up.labels(child.name, child.role).set(0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching: the stack is stopping its children on purpose."""
        self._stopping.set()

    def finish(self) -> None:
        """End the thread once the children are stopped. It outlives `stop()` because Linux
        signals a child whose parent thread exits (the launcher's PR_SET_PDEATHSIG), and the
        children it restarted must be stopped in the stack's order, not all at once."""
        self._stopping.set()
        self._finished.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def restarts(self, name: str) -> int:
        """Restarts of `name` so far."""
        return self._states[name].num_restarts

    def given_up(self) -> set[str]:
        return {name for name, state in self._states.items() if state.given_up}

    def _run(self) -> None:
        while not self._stopping.wait(_POLL_S):
            for state in self._states.values():
                if self._stopping.is_set():
                    break
                self._watch(state, time.monotonic())
        self._finished.wait()

    def _watch(self, state: _State, now: float) -> None:
        child = state.child
        if state.given_up:
            return
        if state.restart_at is not None:
            if now >= state.restart_at:
                self._restart(state, now)
            return
        code = child.exit_code
        if code is not None:
            self._died(state, now, exit_description(code))
        elif state.died_at is not None and child.ready():  # restarted, and ready again
            self._say(f"{child.name} is back, {now - state.died_at:.1f}s after it died")
            self._up.labels(child.name, child.role).set(1)
            state.died_at = None

    def _died(self, state: _State, now: float, what: str) -> None:
        """Schedule the next start of a dead child, or give it up past its budget."""
        child = state.child
        self._up.labels(child.name, child.role).set(0)
        state.died_at = state.died_at or now
        policy = self._policy
        while state.restarts and state.restarts[0] < now - policy.window_s:
            state.restarts.popleft()
        if len(state.restarts) >= policy.budget:
            state.given_up = True
            self._given_up.labels(child.name, child.role).set(1)
            self._say(f"{child.name} {what}; it was restarted {len(state.restarts)} time(s) "
                      f"in the last {policy.window_s:g}s (--restart-budget {policy.budget}): "
                      f"given up. Last lines of its log:\n{child.log_tail()}")
            reason = (self._can_serve(self.given_up()) if policy.budget
                      else f"{child.name} {what} (--restart-budget 0)")
            if reason is not None:
                self._stopping.set()
                self._on_fatal(reason)
            return
        stable = now - state.started_at >= policy.stable_s
        state.backoff_s = (policy.initial_backoff_s if stable or not state.backoff_s
                           else min(state.backoff_s * 2, policy.max_backoff_s))
        state.restart_at = now + state.backoff_s
        self._say(f"{child.name} {what}; restarting it in {state.backoff_s:g}s (restart "
                  f"{len(state.restarts) + 1} of at most {policy.budget} in "
                  f"{policy.window_s:g}s). Last lines of its log:\n{child.log_tail()}")

    def _restart(self, state: _State, now: float) -> None:
        child = state.child
        state.restart_at = None
        state.restarts.append(now)
        state.started_at = now
        state.num_restarts += 1
        self._restarts.labels(child.name, child.role).inc()
        try:
            child.restart()
        except Exception as exc:  # noqa: BLE001 (a start that fails is one more death)
            self._died(state, now, f"could not be started again ({exc})")
            return
        self._say(f"{child.name} started again")
