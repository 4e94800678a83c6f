"""A vision-language worker's image counters, read from its encoder at scrape time.

vllm:mm_cache_queries_total / vllm:mm_cache_hits_total    images a step needed, and those
                                                          whose rows were cached
meshserve:worker_images_encoded_total{where}              rows made here or by services
meshserve:worker_image_encode_seconds_total               engine-thread time making rows
meshserve:worker_image_cache_bytes                        rows held by image hash
Every series carries `model_name` (the served name).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshserve.services.worker.engine.prompt_embeds import PromptEmbedsRows
from meshserve.services.worker.vision.encoder import ImageEncoder


class ImageCollector(Collector):
    """Yields the counters of one engine's ImageEncoder."""

    def __init__(self, encoder: ImageEncoder, model_name: str) -> None:
        self._encoder = encoder
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        e, labels = self._encoder, [self._model_name]
        for name, help_text, value in (
                ("vllm:mm_cache_queries", "Images whose rows a step needed.", e.hits + e.misses),
                ("vllm:mm_cache_hits", "Images whose rows were cached.", e.hits),
                ("meshserve:worker_image_encode_seconds",
                 "Seconds the engine thread spent making image rows itself.",
                 e.encode_seconds)):
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        encoded = CounterMetricFamily("meshserve:worker_images_encoded", "Images turned into "
                                      "rows, by where", labels=["model_name", "where"])
        encoded.add_metric([self._model_name, "worker"], e.encoded_here)
        encoded.add_metric([self._model_name, "encoder"], e.from_services)
        yield encoded
        cached = GaugeMetricFamily("meshserve:worker_image_cache_bytes", "Bytes of image rows "
                                   "kept by image hash", labels=["model_name"])
        cached.add_metric(labels, e.cache.cached_bytes)
        yield cached


def register_image_metrics(registry: CollectorRegistry, encoder: object,
                           model_name: str) -> None:
    """Expose the engine's image counters (nothing for a text model)."""
    if isinstance(encoder, PromptEmbedsRows):  # prompt embeddings on: its images' encoder
        encoder = encoder.images
    if isinstance(encoder, ImageEncoder):
        registry.register(ImageCollector(encoder, model_name))
