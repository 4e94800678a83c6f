"""Unit tests of every routing policy: exact choices, the shared open/full rule, the config."""

from __future__ import annotations

import typing
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from meshserve.local.launcher import LauncherConfig, Stack
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.scheduler.policy import (
    POLICY_NAMES,
    Candidate,
    KVAwarePolicy,
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from meshserve.services.scheduler.service import build_policy
from meshserve.shared.errors import ConfigError


def worker(worker_id: str, *, matched: int = 0, store: int = 0, prompt: int = 5,
           running: int = 0, waiting: int = 0, used: int = 10, free: int = 90,
           max_running: int = 8, draining: bool = False) -> Candidate:
    """`used` blocks in use; as many context blocks of its sequences (the kv-aware load)."""
    return Candidate(worker_id=worker_id, num_running=running, num_waiting=waiting,
                     num_used_blocks=used, num_free_blocks=free, num_total_blocks=100,
                     max_running=max_running, draining=draining, num_prompt_blocks=prompt,
                     num_matched_blocks=matched, num_kvstore_prefix_blocks=store,
                     num_active_blocks=used)


def picks(policy: RoutingPolicy, candidates: list[Candidate], n: int) -> list[str]:
    """The ids of `n` successive choices ("-": none)."""
    chosen = [policy.choose(candidates) for _ in range(n)]
    return [c.worker_id if c is not None else "-" for c in chosen]


# round-robin

def test_round_robin_alternates_whatever_the_cache_and_load() -> None:
    policy = RoundRobinPolicy()
    holder = worker("a", matched=5, used=0)  # holds the whole prompt, idle
    other = worker("b", matched=0, used=80, running=6)
    assert picks(policy, [other, holder], 4) == ["a", "b", "a", "b"]
    assert policy.score(holder) == 0.0


def test_round_robin_skips_closed_workers_without_losing_its_place() -> None:
    policy = RoundRobinPolicy()
    a, b, c = worker("a"), worker("b"), worker("c")
    assert picks(policy, [a, b, c], 2) == ["a", "b"]
    full_c = replace(c, num_running=8)
    assert picks(policy, [a, b, full_c], 1) == ["a"]  # c is full: wraps to a
    assert picks(policy, [a, b, c], 3) == ["b", "c", "a"]
    # A worker joining takes its turn by id: "bb" comes between b and c.
    assert picks(policy, [a, b, worker("bb"), c], 4) == ["b", "bb", "c", "a"]


# least-loaded

def test_least_loaded_picks_the_emptier_worker_and_ignores_the_cache() -> None:
    policy = LeastLoadedPolicy()
    holder = worker("a", matched=5, running=3, used=5)
    emptier = worker("b", matched=0, running=1, waiting=1, used=70)
    assert policy.choose([holder, emptier]) is emptier  # 2 queued < 3, blocks aside
    assert (policy.score(holder), policy.score(emptier)) == (3.0, 2.0)
    # Equal queues: fewer used blocks wins.
    assert policy.choose([worker("a", running=2, used=30),
                          worker("b", running=2, used=20)]).worker_id == "b"


def test_least_loaded_rotates_among_equal_workers() -> None:
    policy = LeastLoadedPolicy()
    equal = [worker("w1"), worker("w0"), worker("w2")]
    assert picks(policy, equal, 6) == ["w0", "w1", "w2", "w0", "w1", "w2"]


# random

def test_random_is_uniform_among_open_workers() -> None:
    policy = RandomPolicy(seed=7)
    workers = [worker("a"), worker("b"), worker("c"), worker("d", draining=True)]
    counts = Counter(picks(policy, workers, 3000))
    assert set(counts) == {"a", "b", "c"}
    # Each expects 1000 (sd ~26): 850..1150 is beyond 5 sd.
    assert all(850 <= counts[w] <= 1150 for w in "abc"), counts


def test_random_is_repeatable_with_a_seed() -> None:
    workers = [worker("a"), worker("b"), worker("c")]
    first = picks(RandomPolicy(seed=3), workers, 50)
    assert picks(RandomPolicy(seed=3), list(reversed(workers)), 50) == first  # order-blind
    assert picks(RandomPolicy(seed=4), workers, 50) != first


# kv-aware

def test_kv_aware_prefers_the_device_holder_then_a_kvstore_prefix() -> None:
    policy = KVAwarePolicy(prefill_weight=1.0)
    device = worker("a", matched=3, store=3)  # 2 to compute: cost 2 + 10
    store = worker("b", matched=0, store=3)  # 3 fetched (0.75) + 2 computed: 12.75
    nothing = worker("c", matched=0, store=0)  # 5 to compute: 15
    assert [policy.cost(c) for c in (device, store, nothing)] == [12.0, 12.75, 15.0]
    assert policy.choose([nothing, store, device]) is device
    assert policy.choose([nothing, store]) is store
    assert policy.score(store) == policy.cost(store)


def test_kv_aware_kvstore_weight_math() -> None:
    # 5 prompt blocks: 2 on the device, the kvstore has 4, so 2 are fetched and 1 computed.
    c = worker("a", matched=2, store=4, used=10)
    assert (c.prefill_blocks, c.store_blocks, c.compute_blocks) == (3, 2, 1)
    assert KVAwarePolicy(prefill_weight=2.0).cost(c) == 2.0 * (2 * 0.25 + 1) + 10
    assert KVAwarePolicy(kvstore_block_weight=0.0).cost(c) == 32 * 1 + 10  # default w 32
    assert KVAwarePolicy(kvstore_block_weight=1.0).cost(c) == 32 * 3 + 10  # as if computed
    # A kvstore prefix shorter than the device's adds nothing.
    short = worker("a", matched=4, store=2)
    assert (short.store_blocks, short.compute_blocks) == (0, 1)
    # Weight 1: a kvstore prefix is worth nothing more than computing, so load decides.
    same = KVAwarePolicy(kvstore_block_weight=1.0)
    assert same.choose([worker("a", store=4, running=2), worker("b", running=1)]).worker_id == "b"


def test_kv_aware_kvstore_weight_must_be_a_fraction() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError):
            KVAwarePolicy(kvstore_block_weight=bad)
        with pytest.raises(ConfigError, match="kvstore_block_weight"):
            SchedulerConfig(kvstore_block_weight=bad)


# every policy

@pytest.mark.parametrize("name", POLICY_NAMES)
def test_full_and_draining_workers_are_never_chosen(name: str) -> None:
    policy = make_policy(name, max_waiting=1, seed=0)
    assert policy.name == name
    closed = [
        worker("a", matched=5, used=0, draining=True),  # the best by cache and load
        worker("b", running=8, waiting=1, used=0),  # max_running + max_waiting admitted
        worker("c", prompt=5, matched=0, free=4, used=0),  # no free blocks for the prompt
    ]
    open_ = worker("d", running=7, used=90, free=10)
    assert set(picks(policy, [*closed, open_], 20)) == {"d"}
    assert picks(policy, closed, 3) == ["-", "-", "-"]
    assert policy.choose([]) is None


def test_policy_names_and_the_config() -> None:
    for config_class in (SchedulerConfig, LauncherConfig):
        assert typing.get_args(typing.get_type_hints(config_class)["routing"]) == POLICY_NAMES
    assert SchedulerConfig().routing == "kv-aware"
    assert build_policy(SchedulerConfig()).name == "kv-aware"
    config = SchedulerConfig.from_args([], environ={"MESHSERVE_ROUTING": "least-loaded"})
    assert isinstance(build_policy(config), LeastLoadedPolicy)
    config = SchedulerConfig.from_args(["--routing", "round-robin", "--kvstore-block-weight",
                                        "0.5"], environ={})
    assert (config.routing, config.kvstore_block_weight) == ("round-robin", 0.5)
    with pytest.raises(ConfigError):
        SchedulerConfig.from_args(["--routing", "sticky"], environ={})
    with pytest.raises(ConfigError, match="routing"):
        make_policy("sticky")


def test_meshserve_up_passes_routing_to_the_scheduler(tmp_path: Path) -> None:
    def scheduler_routing(**values: object) -> str:
        stack = Stack(LauncherConfig(model="m", device="cpu", port=8123, **values), tmp_path)
        stack.redis_url = "redis://127.0.0.1:1/0"
        stack._plan()
        [scheduler] = [s for s in stack.services if s.role == "scheduler"]
        return scheduler.argv[scheduler.argv.index("--routing") + 1]

    assert scheduler_routing() == "kv-aware"
    assert scheduler_routing(routing="round-robin") == "round-robin"
    assert LauncherConfig.from_args(["--routing", "random"], environ={}).routing == "random"
