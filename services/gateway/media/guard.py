"""The SSRF guard: which addresses the gateway may connect to when it fetches a client's URL.

A client's image URL makes the gateway open a connection from inside the deployment, so
only public addresses are reached unless the operator says otherwise: loopback, private
(RFC 1918, unique-local), link-local (cloud metadata at 169.254.169.254 among them),
multicast, reserved, unspecified and every other address that is not globally routable
(shared address space 100.64.0.0/10, documentation ranges) are refused. An IPv6 address
that embeds an IPv4 one (IPv4-mapped ::ffff:a.b.c.d, 6to4, NAT64 64:ff9b::/96) is judged by
the IPv4 address it reaches. `allow_private` lifts the rule; `allowed_networks` lifts it for
the networks listed (an internal image store).

`AddressGuard.resolve` looks a host up once (the resolver is a part: the system's by
default, a fake one in tests), refuses the host if ANY of its addresses is forbidden, and
returns the addresses checked, which the fetcher connects to without a second lookup (a
name that resolves to a public address for the check and to a private one for the
connection, DNS rebinding, gets nowhere).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

from meshserve.services.gateway.media.policy import ImageRefused, Network

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""(host, port) -> the host's addresses as text; OSError when it cannot be resolved."""

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# The address kinds refused, in the order their names are given (the first that applies).
_KINDS = (("unspecified", "is_unspecified"), ("loopback", "is_loopback"),
          ("link-local", "is_link_local"), ("multicast", "is_multicast"),
          ("private", "is_private"), ("reserved", "is_reserved"))
_HOW_TO_ALLOW = "--allow-private-media-urls or --allowed-media-networks allow it"


def embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches, for the forms that embed one."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def forbidden_kind(address: Address) -> str | None:
    """Why `address` must not be reached for a client (None: a public address)."""
    inner = embedded_ipv4(address)
    if inner is not None:
        return forbidden_kind(inner)
    for kind, test in _KINDS:
        if getattr(address, test):
            return kind
    return None if address.is_global else "non-public"


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's addresses from the system's resolver (getaddrinfo, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class AddressGuard:
    """Checks addresses against the rules (module doc) and resolves hosts under them."""

    def __init__(self, *, allow_private: bool = False, allowed_networks: Sequence[Network] = (),
                 resolver: Resolver = system_resolver) -> None:
        self._allow_private = allow_private
        self._allowed = tuple(allowed_networks)
        self._resolver = resolver

    def check(self, host: str, address: Address) -> None:
        """ImageRefused unless the gateway may connect to `address` (which `host` names)."""
        reached = embedded_ipv4(address) or address
        if self._allow_private or any(reached in net for net in self._allowed
                                      if net.version == reached.version):
            return
        kind = forbidden_kind(address)
        if kind is None:
            return
        named = "" if host == str(address) else f"{host} resolves to "
        raise ImageRefused("forbidden", f"{named}{address}, a {kind} address, which the "
                                        f"gateway does not fetch from ({_HOW_TO_ALLOW})")

    async def resolve(self, host: str, port: int) -> list[Address]:
        """Every address of `host`, each checked; ImageRefused if any is forbidden."""
        try:
            names = await self._resolver(host, port)
        except OSError as exc:
            raise ImageRefused("unreachable", f"cannot resolve {host}: "
                                              f"{exc.strerror or exc}") from None
        addresses = [ipaddress.ip_address(name) for name in names]
        if not addresses:
            raise ImageRefused("unreachable", f"{host} has no address")
        for address in addresses:
            self.check(host, address)
        return addresses
