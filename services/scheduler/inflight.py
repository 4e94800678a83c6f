"""Provisional load: requests this scheduler routed that their worker has not reported yet.

Between two heartbeats a worker's reported load is stale; routing a burst on it would
send the whole burst to one worker. So every Route adds its request's sequences and
blocks to the chosen worker here, until the worker's next heartbeat (which counts the
request itself) or a Release. Heartbeats are compared by the scheduler-side time the
registry stamped on them, so a heartbeat received by another replica counts too.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def extra_load(self, worker_id: str, epoch: int, last_heartbeat_unix_ns: int) -> ExtraLoad:
        """Provisional load of a worker, forgetting what its last heartbeat already covers.

        Assignments routed before that heartbeat, or to another epoch of the worker
        (it restarted), are dropped for good.
        """
        assignments = self._by_worker.get(worker_id)
        if not assignments:
            return ExtraLoad()
        stale = [rid for rid, a in assignments.items()
                 if a.epoch != epoch or a.routed_unix_ns < last_heartbeat_unix_ns]
        for rid in stale:
            del assignments[rid]
        if not assignments:
            del self._by_worker[worker_id]
            return ExtraLoad()
        return ExtraLoad(num_sequences=sum(a.num_sequences for a in assignments.values()),
                         num_blocks=sum(a.num_blocks for a in assignments.values()))

    def keep_only(self, live_worker_ids: set[str]) -> None:
        """Forget workers that are no longer registered."""
        for worker_id in [w for w in self._by_worker if w not in live_worker_ids]:
            del self._by_worker[worker_id]
