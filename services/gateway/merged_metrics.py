"""GET /metrics/all: the whole mesh in one scrape.

The gateway fetches every other service's /metrics (the `--metrics-targets` it was given,
`name=url`, and each registered worker's advertised `metrics_url`), adds a `service` label
(the target's name: gateway, tokenizer-0, scheduler, worker-0, ...) and an `instance` label
(its host:port) to every sample, merges families of one name across services, and answers
in the Prometheus text format. A target that does not answer within the timeout is left
out and counted in `meshserve:gateway_merged_scrape_errors_total`, so that one dead
service never empties the scrape. Prometheus keeps its own `instance` on such a target;
the services' arrive as `exported_instance` (or as they are, with `honor_labels: true`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

_FETCH_TIMEOUT_S = 2.0


def parse_targets(entries: Iterable[str]) -> list[tuple[str, str]]:
    """`name=url` entries as (name, url) pairs; ValueError on one without both."""
    targets = []
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"a metrics target is name=url, got {entry!r}")
        targets.append((name, url))
    return targets


def merge(texts: Iterable[tuple[str, str, str]]) -> list[Metric]:
    """Families of several services' exposition texts (service, instance, text), each sample
    labelled with its service and instance, one family per name (its first help and type)."""
    families: dict[str, Metric] = {}
    for service, instance, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "service": service, "instance": instance}
                merged.samples.append(Sample(sample.name, labels, sample.value,
                                             sample.timestamp, sample.exemplar))
    return list(families.values())


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class MergedMetrics:
    """The /metrics/all handler over the gateway's own registry and the other services'."""

    def __init__(self, own: CollectorRegistry, own_name: str, own_instance: str,
                 targets: list[tuple[str, str]],
                 workers: Callable[[], Awaitable[list[tuple[str, str]]]]) -> None:
        """`workers()`: the registered workers' (worker id, metrics URL)."""
        self._own = own
        self._own_name, self._own_instance = own_name, own_instance
        self._targets = targets
        self._workers = workers
        self.errors = Counter("meshserve:gateway_merged_scrape_errors",
                              "Services /metrics/all could not read, by service", ["service"],
                              registry=own)

    async def handle(self, request: web.Request) -> web.Response:
        targets = [*self._targets, *await self._workers()]
        timeout = aiohttp.ClientTimeout(total=_FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            bodies = await asyncio.gather(*(self._fetch(session, name, url)
                                            for name, url in targets))
        own = generate_latest(self._own).decode()
        texts = [(self._own_name, self._own_instance, own),
                 *(body for body in bodies if body is not None)]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(merge(texts)))
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _fetch(self, session: aiohttp.ClientSession, name: str,
                     url: str) -> tuple[str, str, str] | None:
        try:
            async with session.get(url) as response:
                response.raise_for_status()
                return name, urlsplit(url).netloc, await response.text()
        except (aiohttp.ClientError, TimeoutError):
            self.errors.labels(name).inc()
            return None
