"""Unit tests of the kvstore's LRU: exact eviction order, byte accounting, change log."""

from __future__ import annotations

import hashlib

import pytest

from meshserve.services.kvstore.store import KVBlockStore, PutOutcome, StoredBlock
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.kv_events import BlockRemoved, BlockStored

NS = "tiny:float16"


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def block(name: str, elements: int = 12) -> StoredBlock:
    """A float16 block of `elements` values (2 bytes each)."""
    return StoredBlock(block_hash=h(name), data=bytes(2 * elements), dtype="float16",
                   shape=(elements,))


def order(store: KVBlockStore) -> list[bytes]:
    """Held hashes of NS, least recent first."""
    return store.hashes(NS)


def test_least_recently_used_is_evicted_first() -> None:
    store = KVBlockStore(capacity_bytes=72)  # three 24-byte blocks
    for name in "abc":
        assert store.put(NS, block(name)) is PutOutcome.STORED
    assert [b.block_hash for b in store.get_many(NS, [h("a")])] == [h("a")]
    assert order(store) == [h("b"), h("c"), h("a")]
    store.put(NS, block("d"))
    assert order(store) == [h("c"), h("a"), h("d")]
    assert store.put(NS, block("c")) is PutOutcome.PRESENT  # refreshes c
    store.put(NS, block("e"))
    assert order(store) == [h("d"), h("c"), h("e")]
    stats = store.stats()
    assert (stats.num_blocks, stats.used_bytes, stats.evictions, stats.stored) == (3, 72, 2, 5)


def test_byte_accounting_with_mixed_sizes() -> None:
    store = KVBlockStore(capacity_bytes=100)
    store.put(NS, block("small", 10))  # 20 bytes
    store.put(NS, block("big", 30))  # 60 bytes
    assert store.used_bytes == 80
    store.put(NS, block("mid", 15))  # 30 bytes: 110 > 100, evicts "small" only
    assert order(store) == [h("big"), h("mid")]
    assert store.used_bytes == 90
    store.put(NS, block("huge", 45))  # 90 bytes: both go
    assert order(store) == [h("huge")]
    assert (store.used_bytes, store.stats().evictions) == (90, 3)
    assert store.put(NS, block("too-big", 51)) is PutOutcome.REJECTED  # 102 > capacity
    assert order(store) == [h("huge")]


def test_a_chain_loses_its_tail_before_its_head() -> None:
    store = KVBlockStore(capacity_bytes=72)
    outcomes = store.put_many(NS, [block("x0"), block("x1"), block("x2")])  # head first
    assert outcomes == [PutOutcome.STORED] * 3
    assert order(store) == [h("x2"), h("x1"), h("x0")]
    store.put(NS, block("y"))
    assert order(store) == [h("x1"), h("x0"), h("y")]
    # Reading the chain back also leaves its head the most recent.
    got = store.get_many(NS, [h("x0"), h("x1")])
    assert [b.block_hash for b in got] == [h("x0"), h("x1")]
    assert order(store) == [h("y"), h("x1"), h("x0")]


def test_get_counts_hits_and_misses_and_can_stop_at_a_gap() -> None:
    store = KVBlockStore(capacity_bytes=1000)
    store.put_many(NS, [block("a"), block("c")])
    wanted = [h("a"), h("b"), h("c")]
    assert [b.block_hash for b in store.get_many(NS, wanted)] == [h("a"), h("c")]
    assert [b.block_hash for b in store.get_many(NS, wanted, prefix_only=True)] == [h("a")]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (3, 2)
    assert store.contains(NS, h("c")) and not store.contains(NS, h("b"))
    assert store.stats().hits == 3  # contains is not a hit


def test_namespaces_do_not_mix() -> None:
    store = KVBlockStore(capacity_bytes=1000)
    store.put("ns-a", block("x"))
    assert not store.contains("ns-b", h("x"))
    assert store.put("ns-b", block("x")) is PutOutcome.STORED
    assert len(store) == 2
    with pytest.raises(InvalidRequestError):
        store.put("", block("x"))


def test_changes_are_logged_as_events_in_order() -> None:
    store = KVBlockStore(capacity_bytes=48)
    store.put(NS, block("a"))
    store.put(NS, block("b"))
    store.put(NS, block("c"))  # evicts a
    store.put("other", block("a", 1))  # 2 bytes: evicts b
    changes = store.take_changes()
    assert [type(e) for e in changes[NS]] == [BlockStored, BlockRemoved, BlockStored,
                                              BlockRemoved]
    assert [e.block_hashes for e in changes[NS]] == [(h("a"), h("b")), (h("a"),), (h("c"),),
                                                     (h("b"),)]
    assert [e.block_hashes for e in changes["other"]] == [(h("a"),)]
    assert store.take_changes() == {}


def test_blocks_are_validated() -> None:
    with pytest.raises(InvalidRequestError) as err:
        StoredBlock(block_hash=h("a"), data=bytes(10), dtype="float16", shape=(2, 3))
    assert err.value.param == "shape"
    with pytest.raises(InvalidRequestError) as err:
        StoredBlock(block_hash=h("a"), data=bytes(4), dtype="int4", shape=(4,))
    assert err.value.param == "dtype"
    with pytest.raises(InvalidRequestError) as err:
        StoredBlock(block_hash=b"short", data=bytes(4), dtype="float32", shape=(1,))
    assert err.value.param == "block_hash"
    with pytest.raises(InvalidRequestError):
        KVBlockStore(capacity_bytes=0)
