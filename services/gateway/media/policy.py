"""What the gateway accepts as images: `MediaSettings` (from GatewayConfig), the per-prompt
limit as vLLM's `--limit-mm-per-prompt` spells it, and `ImageRefused`, the reason one image
is refused (the loader names the part and turns it into a 400).

`--limit-mm-per-prompt` takes vLLM's forms: JSON `{"image": 4}`, JSON with profiling options
`{"image": {"count": 4, "width": 512, "height": 512}}` (vLLM sizes its memory-profiling
dummies with them; the gateway reads only `count`), or the older `image=4,video=0`. A
modality left out keeps vLLM's default, 999 items per prompt; the gateway serves images
only, so limits on video and audio are checked and have nothing to count.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from meshserve.shared.errors import ConfigError

DEFAULT_ITEMS_PER_PROMPT = 999  # vLLM's default for every modality
MODALITIES = ("image", "video", "audio")
# vLLM's profiling options beside "count", by modality: validated, not used here.
_PROFILING_KEYS = {"image": {"width", "height"}, "video": {"num_frames", "width", "height"},
                   "audio": {"length"}}
_FLAG = "--limit-mm-per-prompt"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ImageRefused(Exception):
    """Why one image cannot be used; `reason` is the metric label (timeout, forbidden, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class MediaSettings:
    """How images are fetched and checked (GatewayConfig.media builds it from the flags)."""

    fetch_timeout_s: float = 5.0  # one image: lookup, connect, redirects and body
    max_bytes: int = 20 * 2**20  # an image file, fetched or in a data URL
    max_redirects: int = 0
    allowed_domains: frozenset[str] = frozenset()  # empty: any host (lower case)
    allow_private: bool = False  # loopback, private, link-local, ... addresses too
    allowed_networks: tuple[Network, ...] = ()  # reachable although not public
    max_pixels: int = 89_478_485  # Pillow's own decompression-bomb threshold
    max_images: int = DEFAULT_ITEMS_PER_PROMPT


def parse_networks(values: tuple[str, ...], param: str) -> tuple[Network, ...]:
    """CIDR networks (`10.1.0.0/16`, `fd00::/8`, a bare address for one host)."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ConfigError(f"--{param.replace('_', '-')}: {value!r} is not a network "
                              "(CIDR such as 10.0.0.0/8, or one address)", param=param) from None
    return tuple(networks)


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """Items allowed per prompt by modality ({} for ""; a modality left out: 999)."""
    text = text.strip()
    if not text:
        return {}
    if text[0] in "{[":
        try:
            value = json.loads(text)
        except ValueError:
            raise _bad(f"not valid JSON: {text!r}") from None
        if not isinstance(value, dict):
            raise _bad(f"must be a JSON object, got {text!r}")
        raw: dict[str, Any] = value
    else:
        raw = dict(_pair(part) for part in text.split(",") if part.strip())
    return {modality: _count(modality, item) for modality, item in raw.items()}


def images_per_prompt(limits: dict[str, int]) -> int:
    return limits.get("image", DEFAULT_ITEMS_PER_PROMPT)


def _pair(part: str) -> tuple[str, Any]:
    modality, sep, count = part.partition("=")
    if not sep or not count.strip().isdigit():
        raise _bad(f"expected JSON such as '{{\"image\": 4}}' or modality=count pairs, got "
                   f"{part!r}")
    return modality.strip(), int(count)


def _count(modality: str, item: Any) -> int:
    if modality not in MODALITIES:
        raise _bad(f"unknown modality {modality!r} (known: {', '.join(MODALITIES)})")
    if isinstance(item, dict):
        unknown = sorted(set(item) - {"count"} - _PROFILING_KEYS[modality])
        if unknown:
            raise _bad(f"{modality}: unknown keys {', '.join(unknown)}")
        for key in set(item) - {"count"}:
            if not _whole(item[key]) or item[key] < 1:
                raise _bad(f"{modality}.{key} must be a positive integer, got {item[key]!r}")
        item = item.get("count", DEFAULT_ITEMS_PER_PROMPT)
    if not _whole(item) or item < 0:
        raise _bad(f"{modality}: the count must be an integer >= 0, got {item!r}")
    return int(item)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(message: str) -> ConfigError:
    return ConfigError(f"{_FLAG}: {message}", param="limit_mm_per_prompt")
