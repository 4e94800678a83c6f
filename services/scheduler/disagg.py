"""Disaggregated prefill/decode routing: which workers may take which part of a request.

Pure logic (no gRPC, no Redis). Workers have a role (`--role`): `prefill` workers compute
prompts and their first tokens, then hand the prompt's KV to a `decode` worker, which
continues the request; `mixed` workers (the default) do both. For one request:

- With no prefill worker serving it, nothing changes: every decode and mixed worker may
  take the whole request (decode workers run whole requests as mixed ones do).
- A prompt shorter than `min_prompt_tokens` skips the prefill pool: moving its KV would cost
  more than computing it where it decodes. It goes whole to a decode or mixed worker (to a
  prefill worker only when no other serves the model).
- Otherwise the prefill pool places the prompt (prefix-aware, by the routing policy) and the
  decode worker is chosen apart by `pick_decode`: load and KV room, not prefix hits (its
  prompt blocks come from the handoff). With no decode worker, mixed ones decode; with
  neither, the prefill worker runs the whole request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from meshserve.shared.worker_registry import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL

# A prompt of a few blocks is cheaper to compute than to hand over. Measured on 2 x H200
# (loadtest/reports/disagg/README.md, "The short-prompt threshold"): no threshold named.
# Under a loaded prefill worker, prompts of 16-1,024 tokens all had a far lower TTFT run
# whole (36-65 ms against 2.3-3.1 s), at no visible ITL cost up to 256 tokens and with the
# decode worker's ITL p99 doubled at 1,024; the default stays until a run names one.
DEFAULT_MIN_PROMPT_TOKENS = 64


class HasRole(Protocol):
    @property
    def role(self) -> str: ...


_W = TypeVar("_W", bound=HasRole)


@dataclass(frozen=True)
class Pools(Generic[_W]):
    """Where a request may go: `first` places it (the prompt, and the whole request when
    `decode` is empty); `decode`, when not empty, is where a prefilled request continues."""

    first: list[_W]
    decode: list[_W]

    @property
    def disaggregated(self) -> bool:
        return bool(self.decode)


def split_pools(workers: Sequence[_W], prompt_tokens: int, min_prompt_tokens: int) -> Pools[_W]:
    """The pools for a request of `prompt_tokens` among `workers` (see the module doc)."""
    prefill = [w for w in workers if w.role == ROLE_PREFILL]
    decode = [w for w in workers if w.role == ROLE_DECODE]
    mixed = [w for w in workers if w.role == ROLE_MIXED]
    whole = decode + mixed
    if not prefill:
        return Pools(whole, [])
    if prompt_tokens < min_prompt_tokens:
        return Pools(whole or prefill, [])
    continuing = decode or mixed
    return Pools(prefill, continuing)


class Load(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...


_L = TypeVar("_L", bound=Load)


def pick_decode(candidates: Sequence[_L], needed_blocks: int) -> _L | None:
    """The decode worker for a prefilled request: among those with room for its
    `needed_blocks` (prompt and expected output), the fewest sequences running and waiting,
    then the most free blocks, then the id; None when none has room."""
    roomy = [c for c in candidates if c.num_free_blocks >= needed_blocks]
    if not roomy:
        return None
    return min(roomy, key=lambda c: (c.num_running + c.num_waiting, -c.num_free_blocks,
                                     c.worker_id))
