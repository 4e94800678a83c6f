"""Disaggregated routing's choices (services/scheduler/disagg.py): which pool places a
request, and which decode worker continues a prefilled one."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.services.scheduler.disagg import pick_decode, split_pools


@dataclass(frozen=True)
class W:
    worker_id: str
    role: str
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 100


P0, P1 = W("p0", "prefill"), W("p1", "prefill")
D0, D1 = W("d0", "decode"), W("d1", "decode")
M0 = W("m0", "mixed")


def ids(workers: list[W]) -> list[str]:
    return [w.worker_id for w in workers]


def test_without_prefill_workers_every_worker_takes_whole_requests() -> None:
    pools = split_pools([M0, D0], prompt_tokens=1000, min_prompt_tokens=64)
    assert ids(pools.first) == ["d0", "m0"]
    assert not pools.disaggregated


def test_a_long_prompt_is_prefilled_on_the_prefill_pool_and_decoded_on_the_decode_pool() -> None:
    pools = split_pools([D0, P0, M0, P1, D1], prompt_tokens=64, min_prompt_tokens=64)
    assert ids(pools.first) == ["p0", "p1"]
    assert ids(pools.decode) == ["d0", "d1"]  # mixed ones decode only when no decode worker
    assert pools.disaggregated


def test_a_short_prompt_skips_the_prefill_pool() -> None:
    pools = split_pools([P0, D0, M0], prompt_tokens=63, min_prompt_tokens=64)
    assert ids(pools.first) == ["d0", "m0"]
    assert not pools.disaggregated
    # With only prefill workers serving, a short prompt still runs (whole, there).
    only = split_pools([P0], prompt_tokens=10, min_prompt_tokens=64)
    assert ids(only.first) == ["p0"] and not only.disaggregated


def test_mixed_workers_decode_when_there_is_no_decode_worker() -> None:
    pools = split_pools([P0, M0], prompt_tokens=500, min_prompt_tokens=64)
    assert ids(pools.first) == ["p0"] and ids(pools.decode) == ["m0"]


def test_prefill_workers_alone_run_whole_requests() -> None:
    pools = split_pools([P0, P1], prompt_tokens=500, min_prompt_tokens=64)
    assert ids(pools.first) == ["p0", "p1"]
    assert not pools.disaggregated


def test_min_prompt_tokens_zero_sends_every_prompt_through_the_prefill_pool() -> None:
    pools = split_pools([P0, D0], prompt_tokens=1, min_prompt_tokens=0)
    assert ids(pools.first) == ["p0"] and ids(pools.decode) == ["d0"]


def test_the_decode_worker_is_the_least_loaded_with_room() -> None:
    busy = W("d0", "decode", num_running=5, num_free_blocks=500)
    idle_small = W("d1", "decode", num_running=0, num_free_blocks=10)
    idle_large = W("d2", "decode", num_running=1, num_waiting=0, num_free_blocks=300)
    assert pick_decode([busy, idle_small, idle_large], needed_blocks=20) is idle_large
    # Room first: the idle worker with 10 free blocks cannot hold 20.
    assert pick_decode([idle_small], needed_blocks=20) is None
    # Equal load: more free blocks, then the id.
    a = W("a", "decode", num_free_blocks=50)
    b = W("b", "decode", num_free_blocks=80)
    c = W("c", "decode", num_free_blocks=80)
    assert pick_decode([a, c, b], needed_blocks=1) is b
    # Waiting sequences count as load.
    queued = W("q", "decode", num_waiting=3, num_free_blocks=1000)
    assert pick_decode([queued, a], needed_blocks=1) is a
