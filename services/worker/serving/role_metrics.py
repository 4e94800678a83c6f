"""The gauge the prefill pool autoscales on, labelled with the worker's role.

The decode pool reads vLLM's `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`;
what saturates a prefill worker is the prompt work it holds, which neither counts: a
queue of three 8k-token prompts is a second of GPU time, three 50-token ones are nothing.
`meshserve:worker_pending_prefill_tokens{role}` is that work (prompt tokens of its running
and waiting sequences not computed yet), read from the engine's load snapshot at scrape
time; the `role` label lets one query sum it per pool (docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from meshserve.shared.worker_registry import WorkerLoad

PENDING_PREFILL_TOKENS = "meshserve:worker_pending_prefill_tokens"


def register_role_gauges(registry: CollectorRegistry, role: str,
                         load: Callable[[], WorkerLoad]) -> None:
    """Export the pending prompt tokens of `load()` (the latest snapshot) under `role`."""
    gauge = Gauge(PENDING_PREFILL_TOKENS, "Prompt tokens of running and waiting sequences "
                  "not computed yet", ["role"], registry=registry)
    gauge.labels(role).set_function(lambda: load().num_pending_prefill_tokens)
