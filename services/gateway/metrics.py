"""Prometheus metrics of the gateway, registered on the process's Telemetry registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Time to first token: sub-10 ms on a warm small model up to minutes in a full queue.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Inter-token latency: a decode step is a few ms to a few hundred ms.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class GatewayMetrics:
    """Request counts, latency histograms and token counters of the HTTP API.

    Inter-token latency is observed once per worker stream message: the gap since the
    previous message divided by the tokens it brought per sequence (messages coalesce
    several decode steps when the reader is slow).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        # What `meshserve up` probes on each gateway's own --metrics-port: with several
        # gateways sharing one HTTP port, /health there may be answered by any of them.
        self.listening = Gauge(
            "meshserve_gateway_http_listening", "1 while this process accepts HTTP connections",
            registry=registry)
        self.requests = Counter(
            "meshserve_gateway_requests", "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"], registry=registry)
        self.in_flight = Gauge(
            "meshserve_gateway_requests_in_flight", "Generation requests being served",
            registry=registry)
        self.ttft = Histogram(
            "meshserve_gateway_time_to_first_token_seconds",
            "Arrival of a generation request until its first output token",
            ["model"], registry=registry, buckets=_TTFT_BUCKETS)
        self.itl = Histogram(
            "meshserve_gateway_inter_token_latency_seconds",
            "Time between output tokens of a sequence, per stream message",
            ["model"], registry=registry, buckets=_ITL_BUCKETS)
        self.e2e = Histogram(
            "meshserve_gateway_e2e_request_latency_seconds",
            "Arrival of a generation request until its last output token",
            ["model"], registry=registry, buckets=_E2E_BUCKETS)
        self.prompt_tokens = Counter(
            "meshserve_gateway_prompt_tokens", "Prompt tokens of finished requests", ["model"],
            registry=registry)
        self.failovers = Counter(
            "meshserve_gateway_failovers",
            "Requests whose worker was lost mid-generation, by outcome (resumed: continued on "
            "another worker; exhausted: past max_failovers; unplaced: no other worker took "
            "it)", ["outcome"], registry=registry)
        self.generation_tokens = Counter(
            "meshserve_gateway_generation_tokens", "Output tokens of finished requests",
            ["model"], registry=registry)
