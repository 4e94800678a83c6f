"""Placeholder of the kvstore client's interface (replaced by the real client)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class KVStoreUnavailable(Exception):
    pass


@dataclass
class Reservation:
    hashes: list[bytes]
    views: list[memoryview | None]


@dataclass
class Lease:
    hashes: list[bytes]
    views: list[memoryview]


class KVStoreClient:
    def __init__(self, address: str, namespace: str, *, shm: bool = True,
                 timeout_s: float = 5.0) -> None:
        raise KVStoreUnavailable("placeholder")

    def connect(self) -> None: ...
    @property
    def shared_memory(self) -> bool: return False
    @property
    def region(self) -> memoryview | None: return None
    def reserve(self, hashes: Sequence[bytes], parents: Sequence[bytes], dtype: str,
                shape: tuple[int, ...]) -> Reservation: raise NotImplementedError
    def commit(self, reservation: Reservation) -> int: raise NotImplementedError
    def abandon(self, reservation: Reservation) -> None: ...
    def acquire(self, hashes: Sequence[bytes]) -> Lease: raise NotImplementedError
    def release(self, lease: Lease) -> None: ...
    def close(self) -> None: ...
