"""The routing policy: which worker serves a request, from cached prefix against load.

Pure logic (no gRPC, no Redis). In the spirit of Dynamo's KV router, each open worker
costs

    cost = prefill_weight * prefill_blocks + decode_blocks

where `prefill_blocks` are the prompt blocks the worker would still have to compute
(prompt blocks minus the leading blocks it already holds) and `decode_blocks` are the KV
blocks its running sequences use. Cache affinity alone would pile every request of a
shared prefix onto one worker; load alone would throw the cache away. Ties go to the
worker running fewer sequences, then rotate round-robin so equal workers share the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.shared.errors import ConfigError


@dataclass(frozen=True)
class Candidate:
    """One worker as the policy sees it for one request (load includes local provisions)."""

    worker_id: str
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_total_blocks: int
    max_running: int
    """Most sequences the worker runs at once (0: unknown, no limit)."""
    draining: bool
    num_prompt_blocks: int
    """Blocks the prompt needs on this worker (its block size, the partial block counted)."""
    num_matched_blocks: int
    """Leading prompt blocks the worker already holds in its prefix cache."""

    @property
    def prefill_blocks(self) -> int:
        """Prompt blocks the worker would still compute."""
        return max(0, self.num_prompt_blocks - self.num_matched_blocks)


class RoutingPolicy:
    """Picks the cheapest open worker; None when every worker is full or draining."""

    def __init__(self, prefill_weight: float = 1.0, max_waiting: int = 0) -> None:
        """`max_waiting`: sequences a worker may queue locally beyond `max_running`."""
        if prefill_weight < 0:
            raise ConfigError(f"prefill_weight must be >= 0, got {prefill_weight}",
                              param="prefill_weight")
        if max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {max_waiting}",
                              param="max_waiting")
        self.prefill_weight = prefill_weight
        self.max_waiting = max_waiting
        self._turn = 0  # advances on every decision: the round-robin tie-break

    def cost(self, candidate: Candidate) -> float:
        """w * blocks to prefill + blocks in use by decoding sequences."""
        return self.prefill_weight * candidate.prefill_blocks + candidate.num_used_blocks

    def is_full(self, candidate: Candidate) -> bool:
        """No room: its queue is past max_running + max_waiting, or no blocks for the prompt."""
        if candidate.max_running > 0:
            admitted = candidate.num_running + candidate.num_waiting
            if admitted >= candidate.max_running + self.max_waiting:
                return True
        if candidate.num_total_blocks > 0:  # 0: the worker did not report its blocks
            return candidate.num_free_blocks < candidate.prefill_blocks
        return False

    def is_open(self, candidate: Candidate) -> bool:
        """Whether the worker may take this request now."""
        return not candidate.draining and not self.is_full(candidate)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        """The open candidate of least cost (ties: fewest running, then round-robin)."""
        turn = self._turn
        self._turn += 1
        open_ = sorted((c for c in candidates if self.is_open(c)), key=lambda c: c.worker_id)
        if not open_:
            return None
        n = len(open_)
        # Rank i - turn (mod n): a different worker heads the tie order on every call.
        rank = {c.worker_id: (i - turn) % n for i, c in enumerate(open_)}
        return min(open_, key=lambda c: (self.cost(c), c.num_running, rank[c.worker_id]))
