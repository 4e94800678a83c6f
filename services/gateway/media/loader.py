"""`MediaLoader`: the images of one prompt, from their parts to checked bytes.

    images = await loader.load(prompt.images)   # [LoadedImage], in conversation order

The count is checked first (`--limit-mm-per-prompt`, as vLLM words it); then every image
is loaded at once: a data URL decoded, an http(s) URL fetched (MediaFetcher), and the file
decoded in a thread (decode.py). The first image refused ends the load, the others are
cancelled, and the request gets a 400 naming the part, its URL and why. The load is one
`load_images` span (images, bytes, how many were fetched); Prometheus counts images by
source, their bytes, refusals by reason, and times every fetch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from meshserve.services.gateway.media.data_url import is_data_url, parse_data_url
from meshserve.services.gateway.media.decode import decode_image
from meshserve.services.gateway.media.fetch import MediaFetcher
from meshserve.services.gateway.media.guard import AddressGuard, Resolver, system_resolver
from meshserve.services.gateway.media.parts import ImageRef
from meshserve.services.gateway.media.policy import ImageRefused, MediaSettings
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.shared.errors import InvalidRequestError, MeshError


@dataclass(frozen=True)
class LoadedImage:
    """One image of a prompt: its size for the tokenizer, its bytes and hash for the worker."""

    where: str  # the part it came from, e.g. messages[0].content[1]
    data: bytes
    sha256: bytes
    width: int
    height: int


class MediaLoader:
    """Loads a prompt's images under MediaSettings (see the module doc)."""

    def __init__(self, settings: MediaSettings, metrics: GatewayMetrics, tracer: Tracer, *,
                 resolver: Resolver = system_resolver) -> None:
        self._settings = settings
        self._metrics = metrics
        self._tracer = tracer
        guard = AddressGuard(allow_private=settings.allow_private,
                             allowed_networks=settings.allowed_networks, resolver=resolver)
        self._fetcher = MediaFetcher(settings, guard)

    async def close(self) -> None:
        await self._fetcher.close()

    async def load(self, images: Sequence[ImageRef]) -> list[LoadedImage]:
        """Every image of `images`, or InvalidRequestError naming the first one refused."""
        if not images:
            return []
        limit = self._settings.max_images
        if len(images) > limit:
            self._metrics.images_refused.labels("limit").inc()
            raise InvalidRequestError(f"At most {limit} image(s) may be provided in one "
                                      "prompt. Set --limit-mm-per-prompt to increase this "
                                      "limit.", param="messages")
        with self._tracer.start_as_current_span("load_images", attributes={
                "meshserve.images.count": len(images)}) as span:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._load_one(ref)) for ref in images]
            except BaseExceptionGroup as failed:
                raise _first_mesh_error(failed) from None
            loaded = [task.result() for task in tasks]
            span.set_attributes({
                "meshserve.images.bytes": sum(len(image.data) for image in loaded),
                "meshserve.images.fetched": sum(not is_data_url(r.url) for r in images)})
        return loaded

    async def _load_one(self, ref: ImageRef) -> LoadedImage:
        try:
            if is_data_url(ref.url):
                source, data = "data", parse_data_url(ref.url, self._settings.max_bytes)
            else:
                source, data = "http", await self._fetch(ref.url)
            decoded = await asyncio.to_thread(decode_image, data, self._settings.max_pixels)
        except ImageRefused as refused:
            self._metrics.images_refused.labels(refused.reason).inc()
            raise InvalidRequestError(f"{ref.where} ({ref.shown}): {refused.message}",
                                      param=ref.where) from None
        self._metrics.images.labels(source).inc()
        self._metrics.image_bytes.labels(source).inc(len(data))
        return LoadedImage(ref.where, data, decoded.sha256, decoded.width, decoded.height)

    async def _fetch(self, url: str) -> bytes:
        start = time.perf_counter()
        try:
            return await self._fetcher.fetch(url)
        finally:
            self._metrics.image_fetch_seconds.observe(time.perf_counter() - start)


def _first_mesh_error(failed: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error a failed load reports: the first domain error, else the first error."""
    errors = failed.exceptions
    return next((exc for exc in errors if isinstance(exc, MeshError)), errors[0])
