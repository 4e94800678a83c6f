"""Unit tests of the kv-aware routing policy: exact choices from prefix hits against load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshserve.services.scheduler.policy import Candidate, KVAwarePolicy
from meshserve.shared.errors import ConfigError


def worker(worker_id: str, *, matched: int = 0, prompt: int = 5, running: int = 0,
           waiting: int = 0, used: int = 10, free: int = 90, max_running: int = 8,
           draining: bool = False, active: int | None = None) -> Candidate:
    """`used` blocks in use; `active` (default: as many as used) the context blocks of its
    sequences, each counted in full: what the kv-aware cost weighs."""
    return Candidate(worker_id=worker_id, num_running=running, num_waiting=waiting,
                     num_used_blocks=used, num_free_blocks=free, num_total_blocks=100,
                     max_running=max_running, draining=draining, num_prompt_blocks=prompt,
                     num_matched_blocks=matched,
                     num_active_blocks=used if active is None else active)


def test_prefix_affinity_wins_when_load_is_equal() -> None:
    policy = KVAwarePolicy(prefill_weight=1.0)
    a, b = worker("a", matched=3), worker("b", matched=0)
    assert (policy.cost(a), policy.cost(b)) == (2 + 10, 5 + 10)
    assert policy.choose([b, a]) is a
    assert policy.choose([a, b]) is a  # whatever the order and the round-robin turn


def test_load_wins_when_the_cached_worker_is_busy() -> None:
    policy = KVAwarePolicy(prefill_weight=1.0)
    cached = worker("a", matched=4, used=50)  # 1 block to prefill, 50 in use: cost 51
    idle = worker("b", matched=0, used=0)  # 5 blocks to prefill: cost 5
    assert policy.choose([cached, idle]) is idle
    # Weighing prefill 20x brings the cache back: 20*1 + 50 = 70 < 20*5 + 0 = 100.
    assert KVAwarePolicy(prefill_weight=20.0).choose([cached, idle]) is cached


def test_saturated_cached_worker_is_skipped() -> None:
    policy = KVAwarePolicy(prefill_weight=1.0, max_waiting=2)
    cached = worker("a", matched=5, used=0, running=8, waiting=2)  # at max and 2 waiting
    other = worker("b", matched=0, used=60, running=3)
    assert policy.is_full(cached)
    assert policy.choose([cached, other]) is other
    # One fewer waiting and it may queue locally again: its prefix wins.
    assert policy.choose([replace(cached, num_waiting=1), other]).worker_id == "a"


def test_no_free_blocks_for_the_prompt_is_full() -> None:
    policy = KVAwarePolicy()
    assert policy.is_full(worker("a", prompt=5, matched=0, free=4))
    assert not policy.is_full(worker("a", prompt=5, matched=1, free=4))  # held blocks need none
    unknown = replace(worker("a", free=0), num_total_blocks=0)  # blocks not reported
    assert not policy.is_full(unknown)
    assert not policy.is_full(worker("a", running=50, max_running=0))  # no limit reported


def test_all_full_gives_none() -> None:
    policy = KVAwarePolicy(max_waiting=0)
    busy = [worker("a", running=8), worker("b", running=4, waiting=4), worker("c", free=0)]
    assert policy.choose(busy) is None
    assert policy.choose([]) is None


def test_draining_workers_are_never_chosen() -> None:
    policy = KVAwarePolicy()
    draining = worker("a", matched=5, used=0, draining=True)
    assert policy.choose([draining, worker("b", used=80)]).worker_id == "b"
    assert policy.choose([draining]) is None


def test_ties_go_to_fewer_running_then_round_robin() -> None:
    policy = KVAwarePolicy()
    assert policy.choose([worker("a", running=3), worker("b", running=1)]).worker_id == "b"
    equal = [worker("w2"), worker("w0"), worker("w1")]
    picks = [policy.choose(equal).worker_id for _ in range(6)]
    # The turn counter was at 1 after the first call above: w1 heads the order first.
    assert picks == ["w1", "w2", "w0", "w1", "w2", "w0"]


def test_bad_parameters_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        KVAwarePolicy(prefill_weight=-1)
    with pytest.raises(ConfigError):
        KVAwarePolicy(max_waiting=-1)


def test_a_shared_prefix_counts_once_per_sequence_in_the_load() -> None:
    # Thirty sequences on one hot 8-block prefix hold 8 + 30 blocks but read 30 * 9 a step:
    # by blocks in use that worker would look nearly idle and take every new request.
    policy = KVAwarePolicy(prefill_weight=1.0)
    hot = worker("a", matched=5, running=30, used=38, active=270)
    idle = worker("b", matched=0, used=0, active=0)
    assert (policy.cost(hot), policy.cost(idle)) == (270, 5)
    assert policy.choose([hot, idle]) is idle
