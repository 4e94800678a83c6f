"""The engine's KV tier on a tiny model: blocks saved by one engine are loaded by another
(through the real transfer thread, over an in-memory store with the client's interface),
and the output equals recomputation; a store that goes away only costs recomputation."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_features import tier_of
from engine_outputs import drain, tokens
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.tier.store_client import KVStoreUnavailable, Lease, Reservation
from meshserve.services.worker.tier.transfer import KVTransfer
from meshserve.shared.sampling_params import SamplingParams

BLOCK = 8


class MemoryStore:
    """Blocks by hash, as the kvstore holds them, with counters."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.up = True
        self.committed = 0
        self.acquired = 0
        self.leases = 0
        self.lock = threading.Lock()


class MemoryClient:
    """KVStoreClient's interface over a MemoryStore (byte path semantics)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.shared_memory = False
        self.region = None

    def _check(self) -> None:
        if not self.store.up:
            raise KVStoreUnavailable("store down")

    def connect(self) -> None:
        self._check()

    def reserve(self, hashes: Sequence[bytes], parents: Sequence[bytes], dtype: str,
                shape: tuple[int, ...]) -> Reservation:
        self._check()
        nbytes = 4 * int(torch.tensor(shape).prod())  # float32 in these tests
        assert dtype == "float32"
        views: list[memoryview | None] = [
            None if h in self.store.blocks else memoryview(bytearray(nbytes)) for h in hashes]
        return Reservation(list(hashes), views)

    def commit(self, reservation: Reservation) -> int:
        self._check()
        with self.store.lock:
            for h, view in zip(reservation.hashes, reservation.views, strict=True):
                if view is not None:
                    self.store.blocks[h] = bytes(view)
                    self.store.committed += 1
        return sum(v is not None for v in reservation.views)

    def abandon(self, reservation: Reservation) -> None:
        pass

    def acquire(self, hashes: Sequence[bytes]) -> Lease:
        self._check()
        found: list[bytes] = []
        for h in hashes:
            if h not in self.store.blocks:
                break
            found.append(h)
        self.store.acquired += len(found)
        self.store.leases += 1
        return Lease(found, [memoryview(self.store.blocks[h]) for h in found])

    def release(self, lease: Lease) -> None:
        self.store.leases -= 1

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tier"), "llama", seed=5)


def make_engine(folder: Path, store: MemoryStore | None, *,
                client: Callable[[], Any] | None = None, backlog: int = 1 << 30,
                retry_s: float = 0.0, **overrides: object
                ) -> tuple[LLMEngine, KVTransfer | None]:
    """An engine over the tiny model; with a store (or a `client` factory), its KV tier
    moves blocks through a started KVTransfer over that client."""
    cfg = {"model": str(folder), "dtype": "float32", "device": "cpu", "num_kv_blocks": 64,
           "block_size": BLOCK, "max_model_len": 256, **overrides}
    config = EngineConfig(**cfg)  # type: ignore[arg-type]
    if client is None and store is not None:
        client = lambda: MemoryClient(store)
    if client is None:
        return build_engine(config), None
    made: list[KVTransfer] = []

    def transport(kv_caches: KVCaches) -> KVTransfer:
        made.append(KVTransfer(client, kv_caches, retry_s=retry_s))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, backlog))
    made[0].start()
    return engine, made[0]


def run(engine: LLMEngine, prompt: list[int], rid: str = "r") -> tuple[list[int], int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))
    outputs = drain(engine)[(rid, 0)]
    return tokens(outputs), outputs[-1].num_cached_tokens


def wait_saved(transfer: KVTransfer, store: MemoryStore, count: int) -> None:
    """Until the transfer thread has written `count` blocks (its queue drains in order)."""
    assert transfer.flush(10), "transfer thread did not drain"
    assert store.committed >= count, f"{store.committed} blocks saved, expected {count}"


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_blocks_saved_by_one_engine_are_loaded_by_another(folder: Path,
                                                          async_scheduling: str) -> None:
    store = MemoryStore()
    rng = random.Random(1)
    prompt = [rng.randrange(3, 200) for _ in range(5 * BLOCK + 3)]
    reference, _ = run(make_engine(folder, None)[0], prompt)

    first, first_transfer = make_engine(folder, store, async_scheduling=async_scheduling)
    assert first_transfer is not None
    out_a, cached_a = run(first, prompt, "a")
    assert out_a == reference and cached_a == 0
    # The 5 prompt blocks, and the blocks decoding filled (prompt + 12 tokens: 6 in all).
    wait_saved(first_transfer, store, 6)
    hashes = first.kv.pool.take_new_cached()  # nothing left unsaved
    assert hashes == []

    second, second_transfer = make_engine(folder, store, async_scheduling=async_scheduling)
    assert second_transfer is not None
    out_b, cached_b = run(second, prompt, "b")
    assert out_b == reference, "KV loaded from the store gave different tokens"
    assert tier_of(second) is not None
    assert tier_of(second).stats.loaded_blocks == 5
    assert second_transfer.stats.loaded_blocks == 5
    assert cached_b == 5 * BLOCK
    assert store.leases == 0, "every lease was released"
    # The loaded KV is exactly what the first engine computed.
    for block_hash, data in list(store.blocks.items())[:5]:
        block = second.kv.pool.get_cached_block(block_hash)
        assert block is not None
        packed = torch.stack([torch.stack([k[block.block_id], v[block.block_id]])
                              for k, v in second.runner.kv_caches])
        assert packed.numpy().tobytes() == data
    first_transfer.stop()
    second_transfer.stop()


def test_a_store_that_is_away_costs_only_recomputation(folder: Path) -> None:
    store = MemoryStore()
    rng = random.Random(2)
    prompt = [rng.randrange(3, 200) for _ in range(4 * BLOCK + 1)]
    reference, _ = run(make_engine(folder, None)[0], prompt)
    engine, transfer = make_engine(folder, store)
    assert transfer is not None and tier_of(engine) is not None
    run(engine, prompt, "warm")
    wait_saved(transfer, store, 4)
    store.up = False
    other, other_transfer = make_engine(folder, store)  # cannot connect: no tier traffic
    assert other_transfer is not None
    out, cached = run(other, prompt, "x")
    assert out == reference and cached == 0
    assert tier_of(other) is not None and tier_of(other).stats.loaded_blocks == 0
    # The store comes back: once reconnected, the blocks load again (the local cache,
    # which computed them meanwhile, is cleared so that only the store has them).
    store.up = True
    assert not other_transfer.available  # asks the thread to reconnect
    wait_saved(other_transfer, store, 4)
    assert other_transfer.available
    assert other.kv.pool.reset_prefix_cache()
    again, cached = run(other, prompt, "y")
    assert again == reference
    assert tier_of(other).stats.loaded_blocks == 4 and cached == 4 * BLOCK
    transfer.stop()
    other_transfer.stop()


def test_saves_past_the_backlog_are_dropped_not_waited_for(folder: Path) -> None:
    store = MemoryStore()
    engine, transfer = make_engine(folder, store, backlog=1, retry_s=2.0)  # nothing fits
    tier = tier_of(engine)
    assert tier is not None and transfer is not None
    rng = random.Random(3)
    out, _ = run(engine, [rng.randrange(3, 200) for _ in range(3 * BLOCK + 2)])
    assert len(out) == 12
    assert tier.stats.dropped_saves >= 3 and tier.stats.saved_blocks == 0
    transfer.stop()


def test_a_request_the_router_saw_no_store_blocks_for_does_not_ask_the_store(
        folder: Path) -> None:
    store = MemoryStore()
    first, first_transfer = make_engine(folder, store)
    rng = random.Random(4)
    prompt = [rng.randrange(3, 200) for _ in range(3 * BLOCK + 1)]
    run(first, prompt)
    assert first_transfer is not None and first_transfer.flush(10)
    second, second_transfer = make_engine(folder, store)
    assert tier_of(second) is not None and second_transfer is not None
    second.add_request("told", prompt, SamplingParams(temperature=0.0, max_tokens=2),
                       store_lookup=False)
    (outputs,) = drain(second).values()
    assert outputs[-1].num_cached_tokens == 0
    assert tier_of(second).stats.probes == 0 and store.acquired == 0
    first_transfer.stop()
    second_transfer.stop()


class GatedClient(MemoryClient):
    """A store whose answers to probes wait for `gate`: blocks that take long to arrive."""

    def __init__(self, store: MemoryStore, gate: threading.Event) -> None:
        super().__init__(store)
        self.gate = gate

    def acquire(self, hashes: Sequence[bytes]) -> Lease:
        assert self.gate.wait(30), "the test never opened the gate"
        return super().acquire(hashes)


def test_the_engine_serves_others_while_a_prompts_blocks_are_on_their_way(
        folder: Path) -> None:
    store = MemoryStore()
    rng = random.Random(2)
    stored = [rng.randrange(3, 200) for _ in range(5 * BLOCK + 3)]
    other = [rng.randrange(3, 200) for _ in range(2 * BLOCK + 1)]
    reference, _ = run(make_engine(folder, None)[0], stored)
    first, first_transfer = make_engine(folder, store)
    assert first_transfer is not None
    run(first, stored, "a")
    wait_saved(first_transfer, store, 5)
    first_transfer.stop()

    gate = threading.Event()
    engine, transfer = make_engine(folder, None, client=lambda: GatedClient(store, gate))
    assert transfer is not None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("loaded", stored, params)
    # The router saw none of its blocks in the store: it does not wait for the store.
    engine.add_request("other", other, params, store_lookup=False)
    outputs: dict[str, list[int]] = {"loaded": [], "other": []}
    finished: set[str] = set()
    # The store holds the first prompt's blocks but has not answered: the other request
    # runs to its end meanwhile, and the first has produced nothing.
    for _ in range(200):
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        if "other" in finished:
            break
    assert finished == {"other"} and len(outputs["other"]) == 12
    assert outputs["loaded"] == []
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert outputs["loaded"] == reference, "KV loaded from the store gave different tokens"
    assert tier_of(engine) is not None and tier_of(engine).stats.loaded_blocks == 5
    transfer.stop()
