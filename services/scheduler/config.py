"""Configuration of the global scheduler service."""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshserve.services.scheduler.disagg import DEFAULT_MIN_PROMPT_TOKENS
from meshserve.services.scheduler.policy import DEFAULT_KVSTORE_BLOCK_WEIGHT, DEFAULT_PREFILL_WEIGHT
from meshserve.shared.config import ServiceConfig, option

DEFAULT_PORT = 50052


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(ServiceConfig):
    """The global scheduler: worker registry, KV-aware routing and the global queue."""

    port: int = option(DEFAULT_PORT, "port of the Scheduler gRPC service (0: any free port)")
    redis_url: str | None = option(None, "Redis holding the registry and block index "
                                         "(unset: start an embedded server)")
    redis_wait_s: float = option(30.0, "how long to wait for Redis to answer before giving up")
    heartbeat_ttl_s: float = option(3.0, "seconds without a heartbeat after which a worker is "
                                         "dropped")
    registration_grace_s: float | None = option(
        None, "seconds after the scheduler starts, and after a worker of the model last "
              "heartbeated or registered here, in which a request for a model no live worker "
              "serves waits in the global queue for a worker to register (a restarted "
              "scheduler, a Redis that came back empty, a worker being restarted) instead of "
              "failing (unset: twice --heartbeat-ttl-s; 0: fail at once)")
    queue_capacity: int = option(1024, "requests that may wait in the global queue while every "
                                       "worker is full (0: refuse at once)")
    max_queue_wait_s: float = option(120.0, "longest a request waits in the queue when neither "
                                            "it nor its call has a deadline")
    # Kept equal to policy.POLICY_NAMES (a unit test checks; compose/local/launcher.py spells
    # them too).
    routing: Literal["kv-aware", "round-robin", "least-loaded", "random"] = option(
        "kv-aware", "how a worker is picked: kv-aware (prefix blocks held against load), "
        "round-robin, least-loaded or random")
    prefill_weight: float = option(DEFAULT_PREFILL_WEIGHT, "weight of a prompt block to prefill against a context "
                                         "block of a sequence already on the worker, in the "
                                         "kv-aware routing cost")
    kvstore_block_weight: float = option(DEFAULT_KVSTORE_BLOCK_WEIGHT, "cost of a prompt block the kvstore holds, as a "
                                               "fraction of one to compute, in the kv-aware "
                                               "routing cost")
    max_waiting_per_worker: int = option(4, "sequences a worker may queue locally beyond its "
                                            "max_running before it counts as full")
    block_size: int = option(16, "tokens per KV block of the mesh (for requests that bring "
                                 "block hashes instead of token ids)")
    disagg_min_prompt_tokens: int = option(
        DEFAULT_MIN_PROMPT_TOKENS, "with prefill workers registered, prompts shorter than this "
        "skip them and run whole on a decode worker (measured on 2 x H200, no threshold "
        "named: loadtest/reports/disagg/README.md)")

    def validate(self) -> None:
        super().validate()
        self.require(self.heartbeat_ttl_s > 0, f"must be positive, got {self.heartbeat_ttl_s}",
                     "heartbeat_ttl_s")
        self.require(self.registration_grace_s is None or self.registration_grace_s >= 0,
                     f"must be >= 0, got {self.registration_grace_s}", "registration_grace_s")
        self.require(self.redis_wait_s > 0, f"must be positive, got {self.redis_wait_s}",
                     "redis_wait_s")
        self.require(self.queue_capacity >= 0, f"must be >= 0, got {self.queue_capacity}",
                     "queue_capacity")
        self.require(self.max_queue_wait_s > 0, f"must be positive, got {self.max_queue_wait_s}",
                     "max_queue_wait_s")
        self.require(self.prefill_weight >= 0, f"must be >= 0, got {self.prefill_weight}",
                     "prefill_weight")
        self.require(0 <= self.kvstore_block_weight <= 1,
                     f"must be in [0, 1], got {self.kvstore_block_weight}",
                     "kvstore_block_weight")
        self.require(self.max_waiting_per_worker >= 0,
                     f"must be >= 0, got {self.max_waiting_per_worker}", "max_waiting_per_worker")
        self.require(self.block_size > 0, f"must be positive, got {self.block_size}",
                     "block_size")
        self.require(self.disagg_min_prompt_tokens >= 0,
                     f"must be >= 0, got {self.disagg_min_prompt_tokens}",
                     "disagg_min_prompt_tokens")

    @property
    def registration_grace(self) -> float:
        """--registration-grace-s, or twice the heartbeat TTL when unset."""
        return (2 * self.heartbeat_ttl_s if self.registration_grace_s is None
                else self.registration_grace_s)

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between heartbeats asked of workers: three fit in one TTL."""
        return self.heartbeat_ttl_s / 3
