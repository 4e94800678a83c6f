"""The gateway's image loading against a real aiohttp server on loopback addresses.

The server (media_server.py) listens on 127.0.0.1 and on 127.0.0.2 and records which
address and path each request reached. Host names are resolved by a fake resolver handed to the loader (the
guard's part), so that a test decides what a name resolves to; 127.0.0.2 plays an allowed
internal image host (`allowed_networks`), 127.0.0.1 the loopback the guard must protect.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest
from media_server import JPEG, PNG, image_server
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from test_gateway_fakes import free_port

from meshserve.services.gateway.media.loader import LoadedImage, MediaLoader
from meshserve.services.gateway.media.parts import ImageRef
from meshserve.services.gateway.media.policy import MediaSettings, parse_networks
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.telemetry import Telemetry

INTERNAL = parse_networks(("127.0.0.2/32",), "allowed_media_networks")


class FakeDNS:
    """Answers from a table, each answer in turn for names given several; counts lookups."""

    def __init__(self, table: dict[str, list[Sequence[str]]]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append(host)
        answers = self.table.get(host)
        if not answers:
            raise OSError(-2, "Name or service not known")
        return answers.pop(0) if len(answers) > 1 else answers[0]


@dataclass
class Loading:
    loader: MediaLoader
    metrics: GatewayMetrics
    registry: CollectorRegistry
    spans: InMemorySpanExporter

    def count(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def loading(dns: FakeDNS | None = None, **settings: object) -> AsyncIterator[Loading]:
    registry, spans = CollectorRegistry(), InMemorySpanExporter()
    metrics = GatewayMetrics(registry)
    telemetry = Telemetry("gateway", span_exporter=spans)
    loader = MediaLoader(replace(MediaSettings(), **settings), metrics,  # type: ignore[arg-type]
                         telemetry.tracer, resolver=dns or FakeDNS({}))
    try:
        yield Loading(loader, metrics, registry, spans)
    finally:
        await loader.close()


def refs(*urls: str) -> list[ImageRef]:
    return [ImageRef(f"messages[0].content[{j}]", url) for j, url in enumerate(urls)]


async def refused(loader: MediaLoader, *urls: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as error:
        await loader.load(refs(*urls))
    return error.value


# -- the guard ------------------------------------------------------------------------------

async def test_loopback_is_refused_by_default_and_nothing_is_sent() -> None:
    dns = FakeDNS({"images.test": [["127.0.0.1"]]})
    async with image_server() as server, loading(dns) as load:
        error = await refused(load.loader, server.url("/cat.png"))
        assert error.param == "messages[0].content[0]"
        assert error.message.startswith(f"messages[0].content[0] ({server.url('/cat.png')}): "
                                        "127.0.0.1, a loopback address")
        by_name = await refused(load.loader, server.url("/cat.png", host="images.test"))
        assert "images.test resolves to 127.0.0.1, a loopback address" in by_name.message
        assert server.hits == []
        assert load.count("meshserve:gateway_images_refused_total", reason="forbidden") == 2


async def test_images_are_fetched_when_private_addresses_are_allowed() -> None:
    async with image_server() as server, loading(allow_private=True) as load:
        png, jpeg = await load.loader.load(refs(server.url("/cat.png"), server.url("/cat.jpg")))
        assert png == LoadedImage("messages[0].content[0]", PNG, hashlib.sha256(PNG).digest(),
                                  32, 24)
        assert (jpeg.width, jpeg.height, jpeg.data) == (40, 30, JPEG)
        assert load.count("meshserve:gateway_images_total", source="http") == 2
        assert load.count("meshserve:gateway_image_bytes_total", source="http") == \
            len(PNG) + len(JPEG)
        assert load.count("meshserve:gateway_image_fetch_seconds_count") == 2
        [span] = [s for s in load.spans.get_finished_spans() if s.name == "load_images"]
        assert dict(span.attributes or {}) == {
            "meshserve.images.count": 2, "meshserve.images.fetched": 2,
            "meshserve.images.bytes": len(PNG) + len(JPEG)}


async def test_a_host_is_refused_if_any_of_its_addresses_is_forbidden() -> None:
    dns = FakeDNS({"mixed.test": [["127.0.0.2", "127.0.0.1"]]})
    async with image_server() as server, loading(dns, allowed_networks=INTERNAL) as load:
        url = server.url("/cat.png", "127.0.0.2", host="mixed.test")
        error = await refused(load.loader, url)
        assert "mixed.test resolves to 127.0.0.1, a loopback address" in error.message
        assert server.hits == []


async def test_the_checked_address_is_the_one_connected_to() -> None:
    # A rebinding name: the first answer is allowed, any later one is loopback. The fetch
    # connects to the address the guard checked, without asking again.
    dns = FakeDNS({"rebind.test": [["127.0.0.2"], ["127.0.0.1"]]})
    async with image_server() as server, loading(dns, allowed_networks=INTERNAL) as load:
        url = server.url("/cat.png", "127.0.0.2", host="rebind.test")
        [image] = await load.loader.load(refs(url))
        assert image.data == PNG
        assert server.hits == [("127.0.0.2", "/cat.png")]
        assert dns.asked == ["rebind.test"]


async def test_a_redirect_to_loopback_is_refused_on_every_hop() -> None:
    dns = FakeDNS({"cdn.test": [["127.0.0.2"]], "evil.test": [["127.0.0.1"]]})
    async with image_server() as server, \
            loading(dns, allowed_networks=INTERNAL, max_redirects=3) as load:
        for target in (server.url("/cat.png"), server.url("/cat.png", host="evil.test")):
            url = server.url(f"/redirect?to={target}", "127.0.0.2", host="cdn.test")
            error = await refused(load.loader, url)
            assert "127.0.0.1, a loopback address" in error.message
        # The allowed host was asked twice; the loopback server never.
        assert server.hits == [("127.0.0.2", "/redirect")] * 2
        # A redirect between allowed addresses is followed.
        inner = server.url("/cat.jpg", "127.0.0.2")
        [image] = await load.loader.load(refs(server.url(f"/redirect?to={inner}", "127.0.0.2")))
        assert image.data == JPEG


async def test_redirects_are_not_followed_by_default() -> None:
    async with image_server() as server, loading(allow_private=True) as load:
        error = await refused(load.loader, server.url(f"/redirect?to={server.url('/cat.png')}"))
        assert "redirects are not followed (--media-max-redirects)" in error.message
        assert server.hits == [("127.0.0.1", "/redirect")]


async def test_only_the_allowed_domains_are_fetched() -> None:
    dns = FakeDNS({"cdn.test": [["127.0.0.2"]], "other.test": [["127.0.0.2"]]})
    async with image_server() as server, loading(
            dns, allowed_networks=INTERNAL, allowed_domains=frozenset({"cdn.test"})) as load:
        error = await refused(load.loader, server.url("/cat.png", "127.0.0.2",
                                                      host="other.test"))
        assert "other.test is not one of the allowed media domains" in error.message
        assert dns.asked == []
        [image] = await load.loader.load(refs(server.url("/cat.png", "127.0.0.2",
                                                          host="CDN.test")))
        assert image.data == PNG


# -- limits and failures --------------------------------------------------------------------

async def test_a_fetch_past_the_timeout_is_refused() -> None:
    async with image_server() as server, \
            loading(allow_private=True, fetch_timeout_s=0.2) as load:
        error = await refused(load.loader, server.url("/slow"))
        assert "fetching it took longer than 0.2s (--media-fetch-timeout-s)" in error.message
        assert load.count("meshserve:gateway_images_refused_total", reason="timeout") == 1


@pytest.mark.parametrize("path", ["/big", "/streamed"])
async def test_a_body_past_the_size_cap_is_refused(path: str) -> None:
    async with image_server() as server, loading(allow_private=True, max_bytes=1000) as load:
        error = await refused(load.loader, server.url(path))
        assert "larger than the 1000 bytes allowed (--media-max-bytes)" in error.message


async def test_what_is_not_an_image_or_not_there_is_named() -> None:
    async with image_server() as server, loading(allow_private=True) as load:
        cases = [("/text", "it is not a PNG, JPEG, WebP or GIF image"),
                 ("/missing", "127.0.0.1 answered HTTP 404")]
        for path, words in cases:
            error = await refused(load.loader, server.url("/cat.png"), server.url(path))
            assert error.param == "messages[0].content[1]", words
            assert words in error.message
        closed = f"http://127.0.0.1:{free_port()}/cat.png"
        assert "cannot fetch it from 127.0.0.1" in (await refused(load.loader, closed)).message
        sent = len(server.hits)
        for url, words in (("ftp://127.0.0.1/cat.png", "only http, https and data: URLs"),
                           ("file:///etc/passwd", "only http, https and data: URLs"),
                           ("http:///cat.png", "has no host"),
                           (server.url("/cat.png", host="user:pw@127.0.0.1"), "credentials")):
            assert words in (await refused(load.loader, url)).message
        assert len(server.hits) == sent


async def test_the_images_of_a_prompt_are_fetched_at_once() -> None:
    # Each /gate request is answered only when both have arrived: fetched one after the
    # other, the first would wait until its timeout.
    async with image_server() as server, loading(allow_private=True) as load:
        images = await load.loader.load(refs(server.url("/gate"), server.url("/gate")))
        assert [i.data for i in images] == [PNG, PNG]


async def test_the_first_refusal_cancels_the_other_fetches() -> None:
    async with image_server() as server, \
            loading(allow_private=True, fetch_timeout_s=60.0) as load:
        async with asyncio.timeout(30):  # the stalled fetch alone would take 60 s
            error = await refused(load.loader, server.url("/slow"), server.url("/text"))
        assert error.param == "messages[0].content[1]"


async def test_too_many_images_are_refused_before_any_fetch() -> None:
    async with image_server() as server, loading(allow_private=True, max_images=1) as load:
        error = await refused(load.loader, server.url("/cat.png"), server.url("/cat.jpg"))
        assert error.message == ("At most 1 image(s) may be provided in one prompt. Set "
                                 "--limit-mm-per-prompt to increase this limit.")
        assert error.param == "messages"
        assert server.hits == []
