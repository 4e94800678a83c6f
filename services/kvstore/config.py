"""Configuration of the kvstore service."""

from __future__ import annotations

import dataclasses
import socket
from typing import Literal

from meshserve.shared.config import ServiceConfig, option

DEFAULT_PORT = 50054


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVStoreConfig(ServiceConfig):
    """The kvstore: a host-memory tier of KV blocks shared by workers."""

    port: int = option(DEFAULT_PORT, "port of the KVStore gRPC service (0: any free port)")
    capacity_bytes: int = option(4 * 2**30, "bytes of block data the store may hold")
    redis_url: str | None = option(None, "Redis holding the KV block index, where the store "
                                         "publishes its holdings (unset: not published)")
    redis_wait_s: float = option(30.0, "how long to wait for Redis to answer before giving up")
    store_id: str | None = option(None, "id of this store in the block index (unset: "
                                        "hostname-port)")
    get_message_bytes: int = option(4 * 2**20, "most block bytes in one Get stream message "
                                               "(a larger block travels alone)")
    shm: Literal["on", "off"] = option("on", "keep blocks in a shared-memory region that "
                                             "same-host clients map and copy in place "
                                             "(off: blocks travel by Put/Get only)")
    lease_s: float = option(30.0, "seconds after which the store ends a reservation or lease "
                                  "its client has not ended (a client that died)")

    def validate(self) -> None:
        super().validate()
        self.require(self.capacity_bytes > 0, f"must be positive, got {self.capacity_bytes}",
                     "capacity_bytes")
        self.require(self.redis_wait_s > 0, f"must be positive, got {self.redis_wait_s}",
                     "redis_wait_s")
        self.require(self.get_message_bytes > 0,
                     f"must be positive, got {self.get_message_bytes}", "get_message_bytes")
        self.require(self.lease_s > 0, f"must be positive, got {self.lease_s}", "lease_s")
        self.require(self.store_id is None or bool(self.store_id.strip()), "must not be blank",
                     "store_id")

    def resolved_store_id(self, bound_port: int) -> str:
        """The configured id, or `<hostname>-<port>` (stable across restarts)."""
        return self.store_id or f"{socket.gethostname()}-{bound_port}"
