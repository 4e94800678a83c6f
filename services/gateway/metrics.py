"""Prometheus metrics of the gateway, registered on the process's Telemetry registry.

Request-level latencies and token counts use vLLM's names, types, buckets and the
`model_name` label (`shared/vllm_metrics.py`), measured where the client sees them: from
the HTTP request's arrival. Their series carry `engine="gateway"` so that a query summing a
vLLM metric over the workers (their `engine` is an engine index) can tell them apart. The
gateway's own metrics live under `meshserve:`; `meshserve:gateway_requests_in_flight` is
the name autoscalers read (compose/k8s).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshserve.shared import vllm_metrics as vm

# The `engine` label of the gateway's vLLM-named series.
GATEWAY_ENGINE = "gateway"
# Seconds of one image fetch, past the default timeout (5 s) for longer --media-fetch-timeout-s.
_FETCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
            "meshserve:gateway_http_listening", "1 while this process accepts HTTP connections",
            registry=registry)
        self.requests = Counter(
            "meshserve:gateway_requests", "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"], registry=registry)
        self.in_flight = Gauge(
            "meshserve:gateway_requests_in_flight", "Generation requests being served",
            registry=registry)
        self.admission_refusals = Counter(
            "meshserve:gateway_admission_refusals",
            "Requests refused with 429 before they started, by reason (ceiling: "
            "max_concurrent_requests in this gateway; queue_delay: the scheduler's estimate of "
            "the wait to start passed max_queue_delay_s or the deadline; queue_full: the "
            "global queue's capacity)", ["reason"], registry=registry)
        self.failovers = Counter(
            "meshserve:gateway_failovers",
            "Requests whose worker was lost mid-generation, by outcome (resumed: continued on "
            "another worker; exhausted: past max_failovers; unplaced: no other worker took "
            "it)", ["outcome"], registry=registry)
        self.detokenize_failovers = Counter(
            "meshserve:gateway_detokenize_failovers",
            "Requests whose detokenize stream broke (its tokenizer replica lost), by outcome "
            "(moved: went on with another stream; unplaced: no replica took it over in time)",
            ["outcome"], registry=registry)
        self.images = Counter(
            "meshserve:gateway_images", "Images of chat requests loaded, by source (data: a "
            "data URL; http: fetched)", ["source"], registry=registry)
        self.image_bytes = Counter(
            "meshserve:gateway_image_bytes", "Bytes of the image files loaded, by source",
            ["source"], registry=registry)
        self.images_refused = Counter(
            "meshserve:gateway_images_refused", "Images refused with a 400, by reason "
            "(forbidden, timeout, too_large, not_image, limit, ...)", ["reason"],
            registry=registry)
        self.image_fetch_seconds = Histogram(
            "meshserve:gateway_image_fetch_seconds", "Time to fetch one image URL: lookup, "
            "connect, redirects and body (failed fetches too)", registry=registry,
            buckets=_FETCH_BUCKETS)
        labels = list(vm.LABELS)
        self.ttft = Histogram(
            vm.TTFT, "Arrival of a generation request at the gateway until its first output "
            "token", labels, registry=registry, buckets=vm.TTFT_BUCKETS)
        self.itl = Histogram(
            vm.ITL, "Time between output tokens of a sequence, per stream message",
            labels, registry=registry, buckets=vm.ITL_BUCKETS)
        self.e2e = Histogram(
            vm.E2E, "Arrival of a generation request at the gateway until its last output "
            "token", labels, registry=registry, buckets=vm.REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Counter(
            vm.PROMPT_TOKENS, "Prompt tokens of finished requests", labels, registry=registry)
        self.generation_tokens = Counter(
            vm.GENERATION_TOKENS, "Output tokens of finished requests", labels,
            registry=registry)
        self.request_success = Counter(
            vm.REQUEST_SUCCESS, "Sequences finished, by finish reason",
            [*labels, "finished_reason"], registry=registry)

    def model(self, model: str) -> tuple[str, str]:
        """The label values (model_name, engine) of a model's series."""
        return model, GATEWAY_ENGINE
