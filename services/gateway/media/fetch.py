"""`MediaFetcher`: GET an image URL for a client, under the guard and the limits.

One aiohttp session per gateway, whose connector resolves every host through the
`AddressGuard` (GuardedResolver) and connects to the addresses it checked, with no DNS
cache and no proxy from the environment. A URL naming an address itself is checked before
the request (aiohttp does not resolve those). Redirects are followed by hand, each hop
checked again (scheme, `--allowed-media-domains`, address), at most `max_redirects` of
them (none by default). The body is read up to `max_bytes` (a larger Content-Length is
refused before reading), and the whole fetch of one image, lookups and every hop
included, runs under `fetch_timeout_s`. Every failure is an ImageRefused saying why.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from meshserve.services.gateway.media.guard import AddressGuard
from meshserve.services.gateway.media.policy import ImageRefused, MediaSettings

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_HEADERS = {"User-Agent": "meshserve-gateway", "Accept": "image/*"}


class GuardedResolver(AbstractResolver):
    """aiohttp's resolver through the guard: the connector gets only checked addresses."""

    def __init__(self, guard: AddressGuard) -> None:
        self._guard = guard

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        addresses = await self._guard.resolve(host, port)
        return [ResolveResult(hostname=host, host=str(a), port=port,
                              family=socket.AF_INET6 if a.version == 6 else socket.AF_INET,
                              proto=0, flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
                for a in addresses]

    async def close(self) -> None:
        return None


class MediaFetcher:
    """Fetches image URLs (see the module doc); `close` at the gateway's stop."""

    def __init__(self, settings: MediaSettings, guard: AddressGuard) -> None:
        self._settings = settings
        self._guard = guard
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, on the serving event loop
            connector = aiohttp.TCPConnector(resolver=GuardedResolver(self._guard),
                                             use_dns_cache=False)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  headers=_HEADERS)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str) -> bytes:
        """The body of an http(s) image URL; ImageRefused when it cannot be had."""
        try:
            parsed = URL(url)
        except (ValueError, TypeError):
            raise ImageRefused("bad_url", "the URL cannot be parsed") from None
        limit = self._settings.fetch_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._follow(parsed)
        except TimeoutError:
            raise ImageRefused("timeout", f"fetching it took longer than {limit:g}s "
                                          "(--media-fetch-timeout-s)") from None

    async def _follow(self, url: URL) -> bytes:
        redirects = self._settings.max_redirects
        for _ in range(redirects + 1):
            self._check(url)
            try:
                async with self._client().get(url, allow_redirects=False) as response:
                    location = response.headers.get("Location")
                    if response.status in _REDIRECTS and location:
                        url = response.url.join(URL(location))
                        continue
                    if response.status != 200:
                        raise ImageRefused("http_status", f"{url.host} answered HTTP "
                                                          f"{response.status}")
                    return await self._body(response)
            except (aiohttp.ClientError, ValueError) as exc:
                raise ImageRefused("unreachable", f"cannot fetch it from {url.host}: "
                                                  f"{_describe(exc)}") from None
        raise ImageRefused("redirect", f"it redirects to {str(url)[:120]}, and "
                                       + ("redirects are not followed" if not redirects else
                                          f"more than {redirects} redirect(s) are not followed")
                                       + " (--media-max-redirects)")

    def _check(self, url: URL) -> None:
        """The rules a URL must meet before anything is sent to it."""
        if url.scheme not in ("http", "https"):
            raise ImageRefused("bad_url", "only http, https and data: URLs are supported, got "
                                          f"{url.scheme or 'no'!r:.20} URL")
        host = (url.raw_host or "").rstrip(".").lower()
        if not host:
            raise ImageRefused("bad_url", "the URL has no host")
        if url.raw_user is not None or url.raw_password is not None:
            raise ImageRefused("bad_url", "URLs with credentials are not fetched")
        domains = self._settings.allowed_domains
        if domains and host not in domains:
            raise ImageRefused("domain", f"{host} is not one of the allowed media domains "
                                         "(--allowed-media-domains)")
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return  # a name: the connector resolves it through the guard
        self._guard.check(host, address)

    async def _body(self, response: aiohttp.ClientResponse) -> bytes:
        cap = self._settings.max_bytes
        too_large = ImageRefused("too_large", f"the image is larger than the {cap} bytes "
                                              "allowed (--media-max-bytes)")
        if response.content_length is not None and response.content_length > cap:
            raise too_large
        data = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            data += chunk
            if len(data) > cap:
                raise too_large
        return bytes(data)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:200]
