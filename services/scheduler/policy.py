"""Routing policies: which open worker serves a request.

Pure logic (no gRPC, no Redis). Every policy shares one rule for whether a worker may take
a request (`is_open`: not draining, not full) and differs only in how it picks among the
open ones:

- `kv-aware` (the default), in the spirit of Dynamo's KV router: the least

      cost = prefill_weight * prefill_cost + active_blocks
      prefill_cost = kvstore_block_weight * store_blocks + compute_blocks

  where `store_blocks` are the prompt blocks past the worker's own prefix that the kvstore
  holds (fetched, not computed), `compute_blocks` the rest the worker must compute, and
  `active_blocks` the context of every sequence the worker runs or queues, each counted
  in full: what its decode steps read. (Blocks in use would undercount: a prefix shared by
  thirty sequences is one set of blocks but thirty reads a step, and a worker serving one
  hot prefix would look idle.) Cache affinity alone would pile every request of a shared
  prefix onto one worker; load alone would throw the cache away. Ties go to fewer
  running, then rotate.
- `round-robin`: strict rotation over the open workers by id, blind to load and cache.
- `least-loaded`: fewest running + waiting, then fewest used blocks, then rotate.
- `random`: uniform among the open workers (seedable).

`round-robin` and `random` are baselines to measure the others against.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from meshserve.shared.errors import ConfigError

PolicyName = Literal["kv-aware", "round-robin", "least-loaded", "random"]
POLICY_NAMES: tuple[PolicyName, ...] = ("kv-aware", "round-robin", "least-loaded", "random")


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
    num_kvstore_prefix_blocks: int = 0
    """Leading prompt blocks a kvstore holds (the most of any kvstore serving its group)."""
    num_active_blocks: int = 0
    """Context blocks of the sequences running or queued there, each sequence counted in
    full (a shared prefix once per sequence)."""

    @property
    def prefill_blocks(self) -> int:
        """Prompt blocks the worker still has to fill (computed or fetched)."""
        return max(0, self.num_prompt_blocks - self.num_matched_blocks)

    @property
    def store_blocks(self) -> int:
        """Prompt blocks past the worker's own prefix that it can fetch from the kvstore."""
        return min(max(0, self.num_kvstore_prefix_blocks - self.num_matched_blocks),
                   self.prefill_blocks)

    @property
    def compute_blocks(self) -> int:
        """Prompt blocks nobody holds: the worker computes them."""
        return self.prefill_blocks - self.store_blocks

    @property
    def num_queued(self) -> int:
        """Sequences admitted to the worker: running and waiting."""
        return self.num_running + self.num_waiting


class RoutingPolicy(ABC):
    """The shared open/full rule and the interface: `choose` and the chosen one's `score`."""

    name: ClassVar[PolicyName]

    def __init__(self, max_waiting: int = 0) -> None:
        """`max_waiting`: sequences a worker may queue locally beyond `max_running`."""
        if max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {max_waiting}",
                              param="max_waiting")
        self.max_waiting = max_waiting
        self._turn = 0  # advances on every decision: the rotating tie-break

    def is_full(self, candidate: Candidate) -> bool:
        """No room: its queue is past max_running + max_waiting, or no blocks for the prompt."""
        admissible = candidate.max_running + self.max_waiting
        if candidate.max_running > 0 and candidate.num_queued >= admissible:
            return True
        if candidate.num_total_blocks > 0:  # 0: the worker did not report its blocks
            return candidate.num_free_blocks < candidate.prefill_blocks
        return False

    def is_open(self, candidate: Candidate) -> bool:
        """Whether the worker may take this request now."""
        return not candidate.draining and not self.is_full(candidate)

    def open_workers(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The open candidates, by worker id."""
        return sorted((c for c in candidates if self.is_open(c)), key=lambda c: c.worker_id)

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        """The worker for the request; None when every worker is full or draining."""

    def score(self, candidate: Candidate) -> float:
        """What the policy minimises, for the record of a decision (0: it does not score)."""
        return 0.0

    def _rotation(self, open_: list[Candidate]) -> dict[str, int]:
        """Tie-break ranks that rotate with each call, so equal workers share the load."""
        turn = self._turn
        self._turn += 1
        n = len(open_)
        # Rank i - turn (mod n): a different worker heads the tie order on every call.
        return {c.worker_id: (i - turn) % n for i, c in enumerate(open_)}


# The kv-aware policy's weights, written once (the scheduler's config takes them as its
# defaults): a prompt block to prefill weighs 32 context blocks (measured on an H100,
# docs/routing.md), a block the kvstore holds a quarter of one to compute.
DEFAULT_PREFILL_WEIGHT = 32.0
DEFAULT_KVSTORE_BLOCK_WEIGHT = 0.25


class KVAwarePolicy(RoutingPolicy):
    """The open worker of least cost (module doc); ties: fewest running, then rotate."""

    name = "kv-aware"

    def __init__(self, prefill_weight: float = DEFAULT_PREFILL_WEIGHT, max_waiting: int = 0,
                 kvstore_block_weight: float = DEFAULT_KVSTORE_BLOCK_WEIGHT) -> None:
        super().__init__(max_waiting)
        if prefill_weight < 0:
            raise ConfigError(f"prefill_weight must be >= 0, got {prefill_weight}",
                              param="prefill_weight")
        if not 0 <= kvstore_block_weight <= 1:
            raise ConfigError(f"kvstore_block_weight must be in [0, 1], got "
                              f"{kvstore_block_weight}", param="kvstore_block_weight")
        self.prefill_weight = prefill_weight
        self.kvstore_block_weight = kvstore_block_weight

    def prefill_cost(self, candidate: Candidate) -> float:
        """Blocks to compute, a block the kvstore holds counting `kvstore_block_weight`."""
        return self.kvstore_block_weight * candidate.store_blocks + candidate.compute_blocks

    def cost(self, candidate: Candidate) -> float:
        """w * prefill cost + the context blocks of the sequences already there."""
        return self.prefill_weight * self.prefill_cost(candidate) + candidate.num_active_blocks

    def score(self, candidate: Candidate) -> float:
        return self.cost(candidate)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        open_ = self.open_workers(candidates)
        rank = self._rotation(open_)
        if not open_:
            return None
        return min(open_, key=lambda c: (self.cost(c), c.num_running, rank[c.worker_id]))


class RoundRobinPolicy(RoutingPolicy):
    """The next open worker by id after the last one chosen, whatever its load or cache."""

    name = "round-robin"

    def __init__(self, max_waiting: int = 0) -> None:
        super().__init__(max_waiting)
        self._last: str | None = None

    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        open_ = self.open_workers(candidates)
        if not open_:
            return None
        # By the last id rather than a counter: a worker joining, leaving or filling up
        # neither skips nor repeats a turn of the others.
        after = [c for c in open_ if self._last is None or c.worker_id > self._last]
        choice = after[0] if after else open_[0]
        self._last = choice.worker_id
        return choice


class LeastLoadedPolicy(RoutingPolicy):
    """Fewest running + waiting, then fewest used blocks, then rotate; blind to the cache."""

    name = "least-loaded"

    def score(self, candidate: Candidate) -> float:
        return float(candidate.num_queued)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        open_ = self.open_workers(candidates)
        rank = self._rotation(open_)
        if not open_:
            return None
        return min(open_, key=lambda c: (c.num_queued, c.num_used_blocks, rank[c.worker_id]))


class RandomPolicy(RoutingPolicy):
    """Uniform among the open workers; `seed` makes the sequence of choices repeatable."""

    name = "random"

    def __init__(self, max_waiting: int = 0, seed: int | None = None) -> None:
        super().__init__(max_waiting)
        self._random = random.Random(seed)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        open_ = self.open_workers(candidates)
        return self._random.choice(open_) if open_ else None


def make_policy(name: str, *, prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
                kvstore_block_weight: float = DEFAULT_KVSTORE_BLOCK_WEIGHT,
                max_waiting: int = 0, seed: int | None = None) -> RoutingPolicy:
    """The policy called `name` (one of POLICY_NAMES); the weights matter to kv-aware only."""
    if name == "kv-aware":
        return KVAwarePolicy(prefill_weight, max_waiting, kvstore_block_weight)
    if name == "round-robin":
        return RoundRobinPolicy(max_waiting)
    if name == "least-loaded":
        return LeastLoadedPolicy(max_waiting)
    if name == "random":
        return RandomPolicy(max_waiting, seed)
    raise ConfigError(f"routing must be one of {list(POLICY_NAMES)}, got {name!r}",
                      param="routing")
