"""The worker's vLLM-named metrics fed from engine steps, the merged scrape's relabelling,
and the launcher's metrics ports (pure logic; the real stack: tests/e2e/test_vllm_metrics.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshserve.local.launcher import LauncherConfig, Stack, child_env
from meshserve.services.gateway.merged_metrics import merge, parse_targets
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.serving.request_stream import SequenceTimes
from meshserve.services.worker.serving.vllm_metrics import (
    WeightedHistogram,
    WorkerVllmMetrics,
    metrics_url_of,
)
from meshserve.shared import vllm_metrics as vm
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.worker_registry import WorkerLoad

LABELS = {"model_name": "tiny", "engine": "0"}


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(registry: CollectorRegistry, name: str, **extra: str) -> float:
    return samples(registry)[(name, frozenset({**LABELS, **extra}.items()))]


def out(request_id: str, tokens: list[int], count: int, *, index: int = 0,
        reason: str | None = None, prompt: int = 5) -> SequenceOutput:
    return SequenceOutput(request_id, request_id, index, tokens, finish_reason=reason,
                         num_prompt_tokens=prompt, num_output_tokens=count)


@pytest.fixture
def worker() -> tuple[CollectorRegistry, WorkerVllmMetrics]:
    registry = CollectorRegistry()
    load = WorkerLoad(num_running=3, num_waiting=2, num_used_blocks=25, num_total_blocks=100)
    metrics = WorkerVllmMetrics(registry, "tiny", 1000, load=lambda: load,
                                totals=lambda: (4, 96, 32),
                                cache_info={"block_size": "16", "num_gpu_blocks": "100"})
    return registry, metrics


def test_weighted_histogram_counts_many_equal_observations_at_once() -> None:
    hist = WeightedHistogram((0.1, 1.0))
    hist.add(0.1, 3)  # on a bound: that bucket (le)
    hist.add(0.5)
    hist.add(7.0, 2)
    assert hist.cumulative() == [("0.1", 3), ("1.0", 4), ("+Inf", 6)]
    assert hist.sum == pytest.approx(0.3 + 0.5 + 14.0)


def test_one_two_five_buckets_end_at_the_context_length() -> None:
    assert vm.build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert vm.build_1_2_5_buckets(4096)[-1] == 2000


def test_scheduler_state_and_cache_totals_are_read_at_scrape(worker) -> None:
    registry, _ = worker
    assert value(registry, "vllm:num_requests_running") == 3
    assert value(registry, "vllm:num_requests_waiting") == 2
    assert value(registry, "vllm:kv_cache_usage_perc") == 0.25
    assert value(registry, "vllm:num_preemptions_total") == 4
    assert value(registry, "vllm:prefix_cache_queries_total") == 96
    assert value(registry, "vllm:prefix_cache_hits_total") == 32
    assert value(registry, "vllm:cache_config_info", block_size="16", num_gpu_blocks="100") == 1


def test_steps_count_tokens_and_finished_sequences(worker) -> None:
    registry, metrics = worker
    times = {"a": SequenceTimes(arrival=0.0, first_scheduled=0.0, first_token=0.0,
                                num_preemptions=0)}
    # Step 1: two sequences of request "a" (n=2) get their first token; prompt counted once.
    metrics.observe_step([out("a", [7], 1), out("a", [8], 1, index=1)], times)
    # Step 2: both decode; sequence 1 stops.
    metrics.observe_step([out("a", [9], 2), out("a", [2], 2, index=1, reason="stop")], times)
    # Step 3: sequence 0 reaches its length limit.
    metrics.observe_step([out("a", [3], 3, reason="length")], times)
    assert value(registry, "vllm:prompt_tokens_total") == 5
    assert value(registry, "vllm:generation_tokens_total") == 5
    assert value(registry, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(registry, "vllm:request_success_total", finished_reason="length") == 1
    assert value(registry, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(registry, "vllm:iteration_tokens_total_count") == 3
    assert value(registry, "vllm:iteration_tokens_total_sum") == 5 + 2 + 2 + 1
    # Three inter-token gaps (two in step 2, one in step 3), under both names.
    assert value(registry, "vllm:inter_token_latency_seconds_count") == 3
    assert value(registry, "vllm:time_per_output_token_seconds_count") == 3
    assert value(registry, "vllm:time_to_first_token_seconds_count") == 2
    assert value(registry, "vllm:request_generation_tokens_sum") == 3 + 2
    assert value(registry, "vllm:request_prompt_tokens_count") == 2
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time"):
        assert value(registry, f"vllm:{name}_seconds_count") == 2


def test_params_histograms_and_vllm_buckets(worker) -> None:
    registry, metrics = worker
    metrics.observe_params(SamplingParams(n=2, max_tokens=30))
    metrics.observe_params(SamplingParams(n=1, max_tokens=100))
    assert value(registry, "vllm:request_params_n_count") == 2
    assert value(registry, "vllm:request_params_n_bucket", le="2.0") == 2
    assert value(registry, "vllm:request_params_max_tokens_sum") == 130
    bounds = {dict(labels)["le"] for (name, labels) in samples(registry)
              if name == "vllm:time_to_first_token_seconds_bucket"}
    assert bounds == {*(repr(float(b)) for b in vm.TTFT_BUCKETS), "+Inf"}


def test_merge_labels_every_sample_with_its_service_and_merges_families() -> None:
    a = "# TYPE x_total counter\nx_total 1.0\n# TYPE up gauge\nup 1.0\n"
    b = "# TYPE x_total counter\nx_total{k=\"v\"} 2.0\n"
    families = {f.name: f for f in merge([("gateway", "h:1", a), ("worker-0", "h:2", b)])}
    assert [(s.labels, s.value) for s in families["x"].samples] == [
        ({"service": "gateway", "instance": "h:1"}, 1.0),
        ({"k": "v", "service": "worker-0", "instance": "h:2"}, 2.0)]
    assert families["x"].type == "counter" and families["up"].type == "gauge"
    assert parse_targets(["scheduler=http://h:3/metrics"]) == [
        ("scheduler", "http://h:3/metrics")]
    with pytest.raises(ValueError):
        parse_targets(["scheduler"])


def test_worker_metrics_url_uses_the_advertised_host() -> None:
    assert metrics_url_of("10.0.0.5:50061", 9100) == "http://10.0.0.5:9100/metrics"
    assert metrics_url_of("10.0.0.5:50061", None) == ""


def test_metrics_port_is_the_base_of_every_services_own_port(tmp_path: Path) -> None:
    config = LauncherConfig(model="m", workers=2, port=0, metrics_port=19000, device="cpu")
    stack = Stack(config, tmp_path, environ={})
    stack.redis_url = "redis://127.0.0.1:1"
    stack._plan()
    ports = {s.name: int(s.metrics_url.rsplit(":", 1)[1].split("/")[0]) for s in stack.services}
    assert ports == {"tokenizer-0": 19001, "scheduler": 19002, "kvstore": 19003,
                     "worker-0": 19004, "worker-1": 19005, "gateway": 19006}
    gateway = next(s for s in stack.services if s.role == "gateway").argv
    targets = gateway[gateway.index("--metrics-targets") + 1].split(",")
    assert targets == [f"{name}=http://127.0.0.1:{ports[name]}/metrics"
                       for name in ("tokenizer-0", "scheduler", "kvstore")]
    # The shared variable is the launcher's; each child gets its own port by flag.
    assert "MESHSERVE_METRICS_PORT" not in child_env("worker", {"MESHSERVE_METRICS_PORT": "9"})
