"""Provisional load: what a worker's last heartbeat does not show yet.

Between two heartbeats a worker's reported load is stale in both directions. Routing a
burst on it would send the whole burst to one worker; and a worker whose requests all
ended just after its heartbeat would look busy for up to a heartbeat interval while the
others take every new request (in closed-loop load the requests of a worker end together,
so the whole next wave would land on the other one). So this replica tracks, per worker:

- every request it routed, from its Route to its Release (or the worker's restart, or
  MAX_TRACK_S without a Release);
- every Release since the worker's last heartbeat.

What the worker's load gets on top of its last heartbeat (compared by the scheduler-side
time the registry stamped on it, so a heartbeat received by another replica counts too):

- requests routed after that heartbeat, in full;
- of those routed less than ARRIVAL_GRACE_S before it, the sequences the heartbeat cannot
  have counted: as many as they outnumber the sequences the worker reported (running +
  waiting), with their share of blocks. A request still on its way to the worker is
  counted, one that arrived is not counted twice;
- minus requests routed before the heartbeat and released after it: the heartbeat counted
  them, they are gone.

The sums can be negative (departures); the router clamps the resulting load at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

ARRIVAL_GRACE_S = 2.0
"""A routed request has reached its worker this long after it was routed (the gateway sends
it at once), so a heartbeat stamped later covers it."""
MAX_TRACK_S = 900.0
"""A request routed this long before its worker's last heartbeat and never released is
forgotten (its Release was lost); forgetting one only costs its departure's correction."""


@dataclass(frozen=True)
class Assignment:
    """One routed request, as provisional load of its worker."""

    request_id: str
    worker_id: str
    epoch: int
    num_sequences: int
    num_blocks: int
    """KV blocks the request will take: prompt blocks to compute plus expected output."""
    routed_unix_ns: int
    num_active_blocks: int = 0
    """Blocks its sequences hold while they run, each counted in full (prompt and expected
    output, times the sequences): what their decode steps read."""


@dataclass(frozen=True)
class ExtraLoad:
    """What a worker's provisional requests add to its reported load (negative: remove)."""

    num_sequences: int = 0
    num_blocks: int = 0
    num_active_blocks: int = 0


class InFlight:
    """Routed requests and recent departures by worker; pure bookkeeping, no I/O."""

    def __init__(self) -> None:
        self._by_worker: dict[str, dict[str, Assignment]] = {}
        self._departed: dict[str, list[tuple[int, Assignment]]] = {}  # (released at, ...)
        # Over every live assignment, kept as they come and go: len() and the mean routing
        # time in O(1) (the wait estimate asks for them on every request it might queue).
        self._count = 0
        self._routed_ns_sum = 0

    def __len__(self) -> int:
        """Requests routed and not released (nor forgotten)."""
        return self._count

    def mean_routed_unix_ns(self) -> int | None:
        """When the requests in flight were routed, on average (None: none is)."""
        return self._routed_ns_sum // self._count if self._count else None

    def add(self, assignment: Assignment) -> None:
        """Count a routed request against its worker."""
        assignments = self._by_worker.setdefault(assignment.worker_id, {})
        replaced = assignments.get(assignment.request_id)
        if replaced is not None:
            self._untrack(replaced)
        assignments[assignment.request_id] = assignment
        self._count += 1
        self._routed_ns_sum += assignment.routed_unix_ns

    def _untrack(self, assignment: Assignment) -> None:
        self._count -= 1
        self._routed_ns_sum -= assignment.routed_unix_ns

    def release(self, request_id: str, worker_id: str, now_unix_ns: int) -> Assignment | None:
        """A request ended at `now_unix_ns`: its assignment; None when it was not tracked
        (any more)."""
        assignments = self._by_worker.get(worker_id)
        if assignments is None:
            return None
        assignment = assignments.pop(request_id, None)
        if assignment is None:
            return None
        self._untrack(assignment)
        if not assignments:
            del self._by_worker[worker_id]
        self._departed.setdefault(worker_id, []).append((now_unix_ns, assignment))
        return assignment

    def extra_load(self, worker_id: str, epoch: int, last_heartbeat_unix_ns: int,
                   reported_sequences: int) -> ExtraLoad:
        """What this replica's bookkeeping adds to a worker's reported load (module doc).

        Assignments to another epoch of the worker (it restarted), departures the heartbeat
        already shows, and assignments older than MAX_TRACK_S are dropped for good.
        """
        heartbeat = last_heartbeat_unix_ns
        live = self._prune_live(worker_id, epoch, heartbeat)
        departed = self._prune_departed(worker_id, epoch, heartbeat)
        new = [a for a in live if a.routed_unix_ns >= heartbeat]
        arriving = [a for a in live
                    if heartbeat - int(ARRIVAL_GRACE_S * 1e9) < a.routed_unix_ns < heartbeat]
        sequences = sum(a.num_sequences for a in new)
        blocks = sum(a.num_blocks for a in new)
        active = sum(a.num_active_blocks for a in new)
        arriving_sequences = sum(a.num_sequences for a in arriving)
        missing = max(0, arriving_sequences - reported_sequences)
        if missing:
            sequences += missing
            blocks += sum(a.num_blocks for a in arriving) * missing // arriving_sequences
            active += sum(a.num_active_blocks for a in arriving) * missing // arriving_sequences
        counted = [a for a in departed if a.routed_unix_ns < heartbeat]
        sequences -= sum(a.num_sequences for a in counted)
        blocks -= sum(a.num_blocks for a in counted)
        active -= sum(a.num_active_blocks for a in counted)
        return ExtraLoad(num_sequences=sequences, num_blocks=blocks, num_active_blocks=active)

    def _prune_live(self, worker_id: str, epoch: int, heartbeat: int) -> list[Assignment]:
        assignments = self._by_worker.get(worker_id)
        if not assignments:
            return []
        forgotten_before = heartbeat - int(MAX_TRACK_S * 1e9)
        for rid in [rid for rid, a in assignments.items()
                    if a.epoch != epoch or a.routed_unix_ns <= forgotten_before]:
            self._untrack(assignments.pop(rid))
        if not assignments:
            del self._by_worker[worker_id]
        return list(assignments.values())

    def _prune_departed(self, worker_id: str, epoch: int, heartbeat: int) -> list[Assignment]:
        departures = self._departed.get(worker_id)
        if not departures:
            return []
        kept = [(at, a) for at, a in departures if at > heartbeat and a.epoch == epoch]
        if kept:
            self._departed[worker_id] = kept
        else:
            del self._departed[worker_id]
        return [a for _, a in kept]

    def keep_only(self, live_worker_ids: set[str]) -> None:
        """Forget workers that are no longer registered."""
        for worker_id in [w for w in self._by_worker if w not in live_worker_ids]:
            for assignment in self._by_worker.pop(worker_id).values():
                self._untrack(assignment)
        for worker_id in [w for w in self._departed if w not in live_worker_ids]:
            del self._departed[worker_id]
