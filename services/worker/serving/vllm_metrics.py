"""The worker's metrics under vLLM's names, types, buckets and labels (shared/vllm_metrics.py).

Three sources, none of which costs the engine thread anything:
- scrape time: scheduler state (running, waiting), KV cache usage, preemptions and
  prefix-cache lookups are read from the engine thread's load snapshot and the local
  scheduler's totals (`EngineStateCollector`);
- each delivered engine step, on the event loop (`EngineThread.on_step`): token counters,
  tokens per iteration, inter-token gaps, and for each sequence that finished its
  request-level histograms (queue, prefill, decode, inference, e2e from the engine's own
  timestamps, prompt and output lengths) and `vllm:request_success` by finish reason;
- each accepted request: its `n` and `max_tokens`.

As in vLLM v1, a request with n > 1 counts as n finished sequences, and prompt tokens are
counted once per request when its first sequence's first token arrives. Inter-token gaps are
the time between the deliveries of a sequence's consecutive tokens; the many sequences of a
step share a few distinct gaps, which `WeightedHistogram` adds in one go each (an observe per
token of a thousand streams would cost the event loop milliseconds a step).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.serving.request_stream import SequenceTimes
from meshserve.shared import vllm_metrics as vm
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.worker_registry import WorkerLoad

WORKER_ENGINE = "0"  # the `engine` label: one engine per worker process


class WeightedHistogram:
    """Cumulative bucket counts that take many equal observations at once."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def add(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs as the text format writes them, +Inf last."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class EngineStateCollector(Collector):
    """vLLM's scheduler-state gauges and cache counters, read when Prometheus scrapes."""

    def __init__(self, labels: tuple[str, str], load: Callable[[], WorkerLoad],
                 totals: Callable[[], tuple[int, int, int]], cache_info: Mapping[str, str],
                 token_gaps: WeightedHistogram) -> None:
        """`totals`: (preemptions, prefix-cache queries, prefix-cache hits) since start."""
        self._labels = list(labels)
        self._load = load
        self._totals = totals
        self._cache_info = dict(cache_info)
        self._gaps = token_gaps

    def collect(self) -> Iterator[Metric]:
        load, labels = self._load(), self._labels
        names = list(vm.LABELS)
        for name, doc, value in (
                (vm.NUM_RUNNING, "Number of requests in model execution batches.",
                 load.num_running),
                (vm.NUM_WAITING, "Number of requests waiting to be processed.",
                 load.num_waiting),
                (vm.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.",
                 load.num_used_blocks / max(load.num_total_blocks, 1))):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(labels, value)
            yield gauge
        preemptions, queries, hits = self._totals()
        for name, doc, total in (
                (vm.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.",
                 preemptions),
                (vm.PREFIX_CACHE_QUERIES,
                 "Prefix cache queries, in terms of number of queried tokens.", queries),
                (vm.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
                 hits)):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(labels, total)
            yield counter
        info = GaugeMetricFamily(vm.CACHE_CONFIG_INFO, "Information of the engine's cache "
                                 "config", labels=[*names, *self._cache_info])
        info.add_metric([*labels, *self._cache_info.values()], 1.0)
        yield info
        # One set of gaps under the current name and vLLM's older one.
        for name, doc in ((vm.ITL, "Histogram of inter-token latency in seconds."),
                          (vm.TPOT_LEGACY, "Histogram of time per output token in seconds.")):
            histogram = HistogramMetricFamily(name, doc, labels=names)
            histogram.add_metric(labels, self._gaps.cumulative(), self._gaps.sum)
            yield histogram


class WorkerVllmMetrics:
    """Registers the worker's vLLM metrics; `observe_step` and `observe_params` feed them."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, *,
                 load: Callable[[], WorkerLoad], totals: Callable[[], tuple[int, int, int]],
                 cache_info: Mapping[str, str]) -> None:
        labels = (model_name, WORKER_ENGINE)
        names = list(vm.LABELS)
        self.token_gaps = WeightedHistogram(vm.ITL_BUCKETS)
        registry.register(EngineStateCollector(labels, load, totals, cache_info,
                                               self.token_gaps))
        lengths = vm.build_1_2_5_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, registry=registry,
                             buckets=buckets).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*labels)

        self.prompt_tokens = counter(vm.PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.generation_tokens = counter(vm.GENERATION_TOKENS,
                                         "Number of generation tokens processed.")
        success = Counter(vm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*labels, reason) for reason in vm.FINISH_REASONS}
        self.iteration_tokens = histogram(vm.ITERATION_TOKENS, "Histogram of number of tokens "
                                          "per engine_step.", vm.ITERATION_TOKENS_BUCKETS)
        self.prompt_len = histogram(vm.REQUEST_PROMPT_TOKENS,
                                    "Number of prefill tokens processed.", lengths)
        self.generation_len = histogram(vm.REQUEST_GENERATION_TOKENS,
                                        "Number of generation tokens processed.", lengths)
        self.params_n = histogram(vm.REQUEST_PARAMS_N, "Histogram of the n request parameter.",
                                  vm.PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(vm.REQUEST_PARAMS_MAX_TOKENS, "Histogram of the "
                                           "max_tokens request parameter.", lengths)
        self.ttft = histogram(vm.TTFT, "Histogram of time to first token in seconds.",
                              vm.TTFT_BUCKETS)
        self.request_tpot = histogram(vm.REQUEST_TPOT, "Histogram of time_per_output_token_"
                                      "seconds per request.", vm.ITL_BUCKETS)
        latency = vm.REQUEST_LATENCY_BUCKETS
        self.e2e = histogram(vm.E2E, "Histogram of e2e request latency in seconds.", latency)
        self.queue = histogram(vm.QUEUE_TIME, "Histogram of time spent in WAITING phase for "
                               "request.", latency)
        self.prefill = histogram(vm.PREFILL_TIME, "Histogram of time spent in PREFILL phase "
                                 "for request.", latency)
        self.decode = histogram(vm.DECODE_TIME, "Histogram of time spent in DECODE phase for "
                                "request.", latency)
        self.inference = histogram(vm.INFERENCE_TIME, "Histogram of time spent in RUNNING "
                                   "phase for request.", latency)
        # (engine request id, sequence index) -> when its latest token was delivered.
        self._last_token: dict[tuple[str, int], float] = {}

    def observe_params(self, params: SamplingParams) -> None:
        """An accepted request's `n` and (when it set one) `max_tokens`."""
        self.params_n.observe(params.n)
        if params.max_tokens:
            self.params_max_tokens.observe(params.max_tokens)

    def observe_step(self, outputs: list[SequenceOutput],
                     times: Mapping[str, SequenceTimes]) -> None:
        """One delivered engine step (EngineThread.on_step, on the event loop)."""
        now = time.monotonic()
        prompt = generated = 0
        gaps: dict[float, int] = {}
        for out in outputs:
            num_new = len(out.new_token_ids)
            generated += num_new
            key = (out.request_id, out.index)
            last = self._last_token.pop(key, None)
            if num_new and out.num_output_tokens == num_new:  # the sequence's first token
                if out.index == 0:
                    prompt += out.num_prompt_tokens
                seq_times = times.get(out.request_id)
                if seq_times is not None:
                    self.ttft.observe(now - seq_times.arrival)
            elif num_new and last is not None:
                gap = (now - last) / num_new
                gaps[gap] = gaps.get(gap, 0) + num_new
            if out.finish_reason is None:
                self._last_token[key] = now if num_new else (last or now)
            else:
                self._finished(out, times.get(out.request_id), now)
        for gap, count in gaps.items():
            self.token_gaps.add(gap, count)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        if prompt + generated:
            self.iteration_tokens.observe(prompt + generated)

    def _finished(self, out: SequenceOutput, times: SequenceTimes | None, now: float) -> None:
        """A sequence finished: its request-level histograms."""
        self.success[out.finish_reason or "abort"].inc()
        self.prompt_len.observe(out.num_prompt_tokens)
        self.generation_len.observe(out.num_output_tokens)
        if times is None:
            return
        scheduled, first = times.first_scheduled, times.first_token
        self.e2e.observe(now - times.arrival)
        self.queue.observe((scheduled if scheduled is not None else now) - times.arrival)
        if scheduled is None:
            return
        self.inference.observe(now - scheduled)
        self.prefill.observe((first if first is not None else now) - scheduled)
        if first is not None:
            self.decode.observe(now - first)
            if out.num_output_tokens > 1:
                self.request_tpot.observe((now - first) / (out.num_output_tokens - 1))


def metrics_url_of(advertised: str, metrics_port: int | None) -> str:
    """The /metrics URL others reach this worker's metrics at: its advertised host and the
    metrics port ("" when it serves none)."""
    if metrics_port is None:
        return ""
    host = advertised.rsplit(":", 1)[0]
    return f"http://{host}:{metrics_port}/metrics"


def vllm_metrics_of(engine: LLMEngine, thread: EngineThread, model_name: str,
                    registry: CollectorRegistry) -> WorkerVllmMetrics:
    """The worker's vLLM metrics over its engine, fed by `thread` from now on."""
    config = engine.config
    cache_info = {"block_size": str(engine.block_size),
                  "num_gpu_blocks": str(engine.num_kv_blocks),
                  "enable_prefix_caching": str(config.enable_prefix_caching),
                  "gpu_memory_utilization": str(config.gpu_memory_utilization)}
    metrics = WorkerVllmMetrics(
        registry, model_name, engine.max_model_len, load=lambda: thread.load,
        totals=engine.cache_counters, cache_info=cache_info)
    thread.on_step = metrics.observe_step
    return metrics
