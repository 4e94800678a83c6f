"""The SSRF guard's address rules, and its lookups through a resolver handed in."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import pytest

from meshserve.services.gateway.media.guard import (
    AddressGuard,
    Resolver,
    embedded_ipv4,
    forbidden_kind,
)
from meshserve.services.gateway.media.policy import ImageRefused, parse_networks
from meshserve.shared.errors import ConfigError


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "loopback"), ("127.9.9.9", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("fd12::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("100.64.0.1", "non-public"),  # shared address space (carrier-grade NAT)
    ("192.0.2.7", "private"),  # documentation range
    # IPv6 forms that reach an IPv4 address are judged by it.
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"),
    ("64:ff9b::7f00:1", "loopback"), ("2002:a9fe:a9fe::1", "link-local"),
    # Public addresses pass.
    ("93.184.215.14", None), ("8.8.8.8", None), ("2606:4700:4700::1111", None),
    ("::ffff:8.8.8.8", None), ("64:ff9b::808:808", None),
])
def test_address_rules(address: str, kind: str | None) -> None:
    assert forbidden_kind(ipaddress.ip_address(address)) == kind


def test_reserved_space_is_refused() -> None:
    # 240.0.0.0/4: ipaddress names it private as well as reserved; either way it is refused.
    assert forbidden_kind(ipaddress.ip_address("240.0.0.1")) in ("private", "reserved")


def test_embedded_ipv4_forms() -> None:
    assert embedded_ipv4(ipaddress.ip_address("::ffff:1.2.3.4")) == ipaddress.ip_address("1.2.3.4")
    assert embedded_ipv4(ipaddress.ip_address("2002:0102:0304::")) == \
        ipaddress.ip_address("1.2.3.4")
    assert embedded_ipv4(ipaddress.ip_address("64:ff9b::102:304")) == \
        ipaddress.ip_address("1.2.3.4")
    assert embedded_ipv4(ipaddress.ip_address("2001:db8::1")) is None
    assert embedded_ipv4(ipaddress.ip_address("1.2.3.4")) is None


def test_check_refuses_with_the_kind_and_how_to_allow_it() -> None:
    with pytest.raises(ImageRefused) as refused:
        AddressGuard().check("metadata.internal", ipaddress.ip_address("169.254.169.254"))
    assert refused.value.reason == "forbidden"
    assert "metadata.internal resolves to 169.254.169.254, a link-local address" in \
        refused.value.message
    assert "--allow-private-media-urls" in refused.value.message
    with pytest.raises(ImageRefused, match=r"^127\.0\.0\.1, a loopback address"):
        AddressGuard().check("127.0.0.1", ipaddress.ip_address("127.0.0.1"))


def test_allow_private_and_allowed_networks_lift_the_rules() -> None:
    loopback, private = ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.2.3.4")
    AddressGuard(allow_private=True).check("h", loopback)
    AddressGuard(allow_private=True).check("h", private)
    only = AddressGuard(allowed_networks=parse_networks(("10.2.0.0/16", "fd00::1"), "n"))
    only.check("h", private)
    only.check("h", ipaddress.ip_address("::ffff:10.2.9.9"))  # the same host, IPv4-mapped
    only.check("h", ipaddress.ip_address("fd00::1"))
    for outside in ("10.3.0.1", "127.0.0.1", "fd00::2"):
        with pytest.raises(ImageRefused):
            only.check("h", ipaddress.ip_address(outside))
    with pytest.raises(ConfigError, match="not a network"):
        parse_networks(("10.0.0.0/33",), "allowed_media_networks")


def _resolver(table: dict[str, Sequence[str]]) -> tuple[Resolver, list[tuple[str, int]]]:
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> Sequence[str]:
        asked.append((host, port))
        if host not in table:
            raise OSError(-2, "Name or service not known")
        return table[host]
    return resolve, asked


async def test_resolve_refuses_a_host_if_any_of_its_addresses_is_forbidden() -> None:
    resolve, asked = _resolver({"public.test": ["8.8.8.8", "2606:4700:4700::1111"],
                                "mixed.test": ["8.8.8.8", "10.0.0.5"],
                                "empty.test": []})
    guard = AddressGuard(resolver=resolve)
    assert [str(a) for a in await guard.resolve("public.test", 443)] == \
        ["8.8.8.8", "2606:4700:4700::1111"]
    with pytest.raises(ImageRefused, match=r"mixed\.test resolves to 10\.0\.0\.5, a private"):
        await guard.resolve("mixed.test", 80)
    with pytest.raises(ImageRefused, match="has no address") as refused:
        await guard.resolve("empty.test", 80)
    assert refused.value.reason == "unreachable"
    with pytest.raises(ImageRefused, match="cannot resolve nowhere.test: Name or service"):
        await guard.resolve("nowhere.test", 80)
    assert asked == [("public.test", 443), ("mixed.test", 80), ("empty.test", 80),
                     ("nowhere.test", 80)]
