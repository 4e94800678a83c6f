"""Provisional load: requests this scheduler routed that their worker may not count yet.

Between two heartbeats a worker's reported load is stale; routing a burst on it would
send the whole burst to one worker. So every Route counts its request's sequences and
blocks against the chosen worker here until its Release, the worker's restart, or a
heartbeat stamped ARRIVAL_GRACE_S after it was routed (by then the worker counts it
itself, or its Release was lost). What the worker's load gets on top of its last heartbeat
(compared by the scheduler-side time the registry stamped on it, so a heartbeat received
by another replica counts too):
- requests routed after that heartbeat, in full;
- of those routed less than ARRIVAL_GRACE_S before it, the sequences the heartbeat cannot
  have counted: as many as they outnumber the sequences the worker reported (running +
  waiting), with their share of blocks. A request still on its way to the worker is
  counted, one that arrived is not counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

ARRIVAL_GRACE_S = 2.0
"""A routed request has reached its worker this long after it was routed (the gateway sends
it at once), so a heartbeat stamped later covers it."""


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


@dataclass(frozen=True)
class ExtraLoad:
    """What a worker's provisional requests add to its reported load."""

    num_sequences: int = 0
    num_blocks: int = 0


class InFlight:
    """Provisional assignments by worker; pure bookkeeping, no I/O."""

    def __init__(self) -> None:
        self._by_worker: dict[str, dict[str, Assignment]] = {}

    def __len__(self) -> int:
        return sum(len(a) for a in self._by_worker.values())

    def add(self, assignment: Assignment) -> None:
        """Count a routed request against its worker."""
        self._by_worker.setdefault(assignment.worker_id, {})[assignment.request_id] = assignment

    def release(self, request_id: str, worker_id: str) -> bool:
        """Drop a request that ended; False when it was not tracked (any more)."""
        assignments = self._by_worker.get(worker_id)
        if assignments is None or assignments.pop(request_id, None) is None:
            return False
        if not assignments:
            del self._by_worker[worker_id]
        return True

    def extra_load(self, worker_id: str, epoch: int, last_heartbeat_unix_ns: int,
                   reported_sequences: int) -> ExtraLoad:
        """What this replica's routed requests add to a worker's reported load (module doc).

        Assignments to another epoch of the worker (it restarted), or that a heartbeat
        stamped ARRIVAL_GRACE_S after their routing covers, are dropped for good.
        """
        assignments = self._by_worker.get(worker_id)
        if not assignments:
            return ExtraLoad()
        covered_before = last_heartbeat_unix_ns - int(ARRIVAL_GRACE_S * 1e9)
        for rid in [rid for rid, a in assignments.items()
                    if a.epoch != epoch or a.routed_unix_ns <= covered_before]:
            del assignments[rid]
        if not assignments:
            del self._by_worker[worker_id]
            return ExtraLoad()
        new = [a for a in assignments.values() if a.routed_unix_ns >= last_heartbeat_unix_ns]
        covered = [a for a in assignments.values() if a.routed_unix_ns < last_heartbeat_unix_ns]
        sequences = sum(a.num_sequences for a in new)
        blocks = sum(a.num_blocks for a in new)
        covered_sequences = sum(a.num_sequences for a in covered)
        missing = max(0, covered_sequences - reported_sequences)
        if missing:
            sequences += missing
            blocks += sum(a.num_blocks for a in covered) * missing // covered_sequences
        return ExtraLoad(num_sequences=sequences, num_blocks=blocks)

    def keep_only(self, live_worker_ids: set[str]) -> None:
        """Forget workers that are no longer registered."""
        for worker_id in [w for w in self._by_worker if w not in live_worker_ids]:
            del self._by_worker[worker_id]
