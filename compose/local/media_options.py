"""The image-fetching options of the commands that run the gateway's image handling:
`meshserve up` (handed to its gateways) and `meshserve run-batch` (in process)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshserve.shared.config import Config, option

if TYPE_CHECKING:
    from meshserve.services.gateway.media.policy import MediaSettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class MediaOptions(Config):
    """How image URLs in chats are fetched and checked (the gateway's flags)."""

    limit_mm_per_prompt: str = option("", "images allowed per prompt, as vLLM's JSON: "
                                          "'{\"image\": 4}'")
    media_fetch_timeout_s: float = option(5.0, "seconds to fetch one image URL")
    allowed_media_domains: tuple[str, ...] = option(
        (), "hosts image URLs may name, comma-separated (empty: any host)")
    allow_private_media_urls: bool = option(
        False, "let image URLs reach loopback and other non-public addresses (an SSRF guard "
               "refuses them when off)")
    allowed_media_networks: tuple[str, ...] = option(
        (), "non-public networks (CIDR, comma-separated) image URLs may reach")

    def media_flags(self) -> list[str]:
        """These options as the gateway's flags (those not at their defaults)."""
        flags = ["--media-fetch-timeout-s", str(self.media_fetch_timeout_s)]
        if self.limit_mm_per_prompt:
            flags += ["--limit-mm-per-prompt", self.limit_mm_per_prompt]
        for flag, values in (("--allowed-media-domains", self.allowed_media_domains),
                             ("--allowed-media-networks", self.allowed_media_networks)):
            if values:
                flags += [flag, ",".join(values)]
        if self.allow_private_media_urls:
            flags.append("--allow-private-media-urls")
        return flags

    def media_settings(self) -> MediaSettings:
        """These options as the gateway's MediaSettings (run-batch loads images itself)."""
        from meshserve.services.gateway.media.policy import (
            MediaSettings,
            images_per_prompt,
            parse_limit_mm_per_prompt,
            parse_networks,
        )

        return MediaSettings(
            fetch_timeout_s=self.media_fetch_timeout_s,
            allowed_domains=frozenset(d.strip().rstrip(".").lower()
                                      for d in self.allowed_media_domains),
            allow_private=self.allow_private_media_urls,
            allowed_networks=parse_networks(self.allowed_media_networks,
                                            "allowed_media_networks"),
            max_images=images_per_prompt(parse_limit_mm_per_prompt(self.limit_mm_per_prompt)))
