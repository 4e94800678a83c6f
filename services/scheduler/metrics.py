"""Prometheus metrics of the scheduler (RPC counts and latencies come from Telemetry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshserve.services.scheduler.queue import GlobalQueue
from meshserve.services.scheduler.router import RouteDecision

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
# 0 (a miss) apart from the rest: the lowest bucket counts the requests that found nothing.
_OVERLAP_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class SchedulerMetrics:
    """Routing outcomes, prefix hits and the global queue."""

    def __init__(self, registry: CollectorRegistry, queue: GlobalQueue) -> None:
        self.routed = Counter("meshserve:scheduler_routed_total",
                              "Requests placed on a worker", ["worker_id"], registry=registry)
        self.matched_blocks = Counter(
            "meshserve:scheduler_matched_blocks_total",
            "Prompt blocks the chosen worker already held", registry=registry)
        self.kvstore_blocks = Counter(
            "meshserve:scheduler_kvstore_blocks_total",
            "Further prompt blocks the kvstore held for the chosen worker", registry=registry)
        self.overlap = Histogram(
            "meshserve:scheduler_route_overlap_ratio",
            "Fraction of the prompt's blocks the chosen worker held on its device",
            registry=registry, buckets=_OVERLAP_BUCKETS)
        self.prompt_tokens = Counter(
            "meshserve:scheduler_prompt_tokens_total", "Prompt tokens of the requests routed",
            registry=registry)
        self.matched_tokens = Counter(
            "meshserve:scheduler_matched_prompt_tokens_total",
            "Prompt tokens the chosen worker held on its device (over prompt_tokens_total: "
            "the prefix hit rate)", registry=registry)
        # Labels stay bounded: four policies, and worker ids name a fixed set of replicas.
        self.decisions = Counter(
            "meshserve:scheduler_route_decisions_total", "Routing decisions by policy and worker",
            ["policy", "worker_id"], registry=registry)
        self.queue_wait = Histogram(
            "meshserve:scheduler_queue_wait_seconds", "Time requests waited in the global queue",
            registry=registry, buckets=_WAIT_BUCKETS)
        self.queue_depth = Gauge("meshserve:scheduler_queue_depth",
                                 "Requests waiting in the global queue", registry=registry)
        self.queue_depth.set_function(lambda: len(queue))
        self.wait_estimate = Gauge(
            "meshserve:scheduler_wait_estimate_seconds",
            "Estimated wait to start of a request that would find every worker full now: "
            "(queued + 1) x mean route-to-release time / requests in service (0: no estimate; "
            "past a request's max_queue_delay_s it is refused with 429)", registry=registry)
        self.redis_up = Gauge("meshserve:scheduler_redis_up",
                              "0 while Redis is unreachable (placement by load only)",
                              registry=registry)

    def observe(self, decision: RouteDecision) -> None:
        """Count one placement (the Router's on_route hook)."""
        self.routed.labels(decision.worker_id).inc()
        self.matched_blocks.inc(decision.num_matched_blocks)
        self.kvstore_blocks.inc(decision.num_kvstore_blocks)
        self.overlap.observe(decision.overlap)
        self.prompt_tokens.inc(decision.num_prompt_tokens)
        self.matched_tokens.inc(decision.num_matched_tokens)
        self.decisions.labels(decision.policy, decision.worker_id).inc()
        self.queue_wait.observe(decision.queued_ns / 1e9)
