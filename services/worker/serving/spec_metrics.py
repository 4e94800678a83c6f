"""Speculative decoding counters under vLLM's names, read from the engine at scrape time.

vllm:spec_decode_num_drafts_total               sequences x steps that verified drafts
vllm:spec_decode_num_draft_tokens_total         draft tokens verified
vllm:spec_decode_num_accepted_tokens_total      draft tokens accepted
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="j"}
                                                drafts accepted at position j (0-based)
Every series carries `model_name` (the served name). Mean accepted length per draft is
1 + accepted / drafts; the acceptance rate is accepted / draft tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from meshserve.services.worker.spec.decoder import SpecDecoder

PREFIX = "vllm:spec_decode_"


class SpecDecodeCollector(Collector):
    """Yields the counters of one engine's SpecDecoder."""

    def __init__(self, spec: SpecDecoder, model_name: str) -> None:
        self._read: Callable[[], tuple[int, int, int, list[int]]] = spec.stats.snapshot
        self._positions = spec.config.num_speculative_tokens
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        drafts, draft_tokens, accepted, per_pos = self._read()
        labels = [self._model_name]
        for name, help_text, value in (
                ("num_drafts", "Number of spec decoding drafts.", drafts),
                ("num_draft_tokens", "Number of draft tokens.", draft_tokens),
                ("num_accepted_tokens", "Number of accepted tokens.", accepted)):
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        family = CounterMetricFamily(PREFIX + "num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.",
                                     labels=["model_name", "position"])
        for position in range(max(self._positions, len(per_pos))):
            count = per_pos[position] if position < len(per_pos) else 0
            family.add_metric([self._model_name, str(position)], count)
        yield family


def register_spec_metrics(registry: CollectorRegistry, spec: SpecDecoder | None,
                          model_name: str) -> None:
    """Expose the engine's speculation counters (nothing when it does not speculate)."""
    if spec is not None:
        registry.register(SpecDecodeCollector(spec, model_name))
