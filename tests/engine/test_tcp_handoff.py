"""The TCP KV handoff between two engines on a tiny model (services/worker/tier/tcp_handoff.py):
the prefill engine's transfer thread holds the prompt's blocks and its listener serves
them; the decode engine, told where they wait, probes, allocates and pulls them over
several real TCP streams, and its output equals recomputation with the pulled KV bit-exact;
the pulled blocks leave the prefill side; a source that is gone, or that does not answer
within the timeout, costs only recomputation. With the blocks held in a mappable pool
(--kv-handoff ipc; shared memory on a CPU) the decode engine copies them straight from the
mapped pool, bit-exact, and the slots come back; one that cannot map it pulls over TCP."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_features import tier_of
from engine_outputs import drain, tokens
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.tier import tcp_handoff
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.sampling_params import SamplingParams

BLOCK = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tcp-handoff"), "llama", seed=6)


def make_engine(folder: Path, holder: BlockHolder | None, timeout_s: float = 5.0,
                pool: SlotPool | None = None) -> tuple[LLMEngine, TcpTransfer]:
    config = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
                          block_size=BLOCK, max_model_len=256)
    made: list[TcpTransfer] = []

    def transport(kv_caches: KVCaches) -> TcpTransfer:
        made.append(TcpTransfer(kv_caches, holder=holder, pool=pool, streams=3,
                                timeout_s=timeout_s))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, 1 << 30))
    made[0].start()
    return engine, made[0]


@pytest.fixture
def prefill(folder: Path) -> Iterator[tuple[LLMEngine, TcpTransfer, str]]:
    holder = BlockHolder(1 << 30, 60.0)
    server = BlockServer(holder, "127.0.0.1")
    server.start()
    engine, transfer = make_engine(folder, holder)
    try:
        yield engine, transfer, f"127.0.0.1:{server.port}"
    finally:
        transfer.stop()
        server.stop()


@pytest.fixture
def pooled(folder: Path) -> Iterator[tuple[LLMEngine, TcpTransfer, str, SlotPool]]:
    pool = SlotPool(8 << 20, torch.device("cpu"))
    holder = BlockHolder(1 << 30, 60.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    engine, transfer = make_engine(folder, holder, pool=pool)
    try:
        yield engine, transfer, f"127.0.0.1:{server.port}", pool
    finally:
        transfer.stop()
        server.stop()


def run(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True))
    outputs = drain(engine)[(rid, 0)]
    return tokens(outputs), outputs[-1].num_cached_tokens


def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 200) for _ in range(5 * BLOCK + 3)]


def cached_bytes(engine: LLMEngine, block_hash: bytes) -> bytes:
    block = engine.kv.pool.get_cached_block(block_hash)
    assert block is not None
    return torch.stack([torch.stack([k[block.block_id], v[block.block_id]])
                        for k, v in engine.runner.kv_caches]).numpy().tobytes()


def test_prompt_blocks_pulled_over_tcp_decode_as_recomputed(
        folder: Path, prefill: tuple[LLMEngine, TcpTransfer, str]) -> None:
    first, first_transfer, source = prefill
    reference, _ = run(first, prompt(), "p")
    assert first_transfer.flush(10)
    holder = first_transfer.holder
    assert holder is not None and holder.stats.held_blocks >= 5
    hashes = hash_blocks(prompt(), BLOCK)
    assert len(hashes) == 5
    computed = {h: cached_bytes(first, h) for h in hashes}

    second, second_transfer = make_engine(folder, None)
    try:
        second_transfer.expect("d", source)
        out, cached = run(second, prompt(), "d")
        assert out == reference, "KV pulled over TCP gave different tokens"
        assert cached == 5 * BLOCK
        tier = tier_of(second)
        assert tier is not None and tier.stats.loaded_blocks == 5
        assert second_transfer.stats.pulled_blocks == 5
        for h in hashes:
            assert cached_bytes(second, h) == computed[h], "a pulled block is not bit-exact"
        # Pulled blocks are freed on the prefill side (the rest wait for their hold time).
        assert holder.stats.pulled_blocks == 5
        assert holder.num_held(hashes) == 0
    finally:
        second_transfer.stop()


def test_a_source_that_is_gone_costs_only_recomputation(
        folder: Path, prefill: tuple[LLMEngine, TcpTransfer, str]) -> None:
    first, _, _ = prefill
    reference, _ = run(first, prompt(), "p")
    second, second_transfer = make_engine(folder, None)
    try:
        second_transfer.expect("d", closed_address())
        out, cached = run(second, prompt(), "d")
    finally:
        second_transfer.stop()
    assert out == reference and cached == 0
    tier = tier_of(second)
    assert tier is not None and tier.stats.probes == 1 and tier.stats.loaded_blocks == 0


def test_a_source_that_does_not_answer_in_time_costs_only_recomputation(
        folder: Path, prefill: tuple[LLMEngine, TcpTransfer, str]) -> None:
    first, _, _ = prefill
    reference, _ = run(first, prompt(), "p")
    # A listener that never answers: connections complete in its backlog, nothing is read.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        second, second_transfer = make_engine(folder, None, timeout_s=0.5)
        try:
            second_transfer.expect("d", f"127.0.0.1:{silent.getsockname()[1]}")
            started = time.monotonic()
            out, cached = run(second, prompt(), "d")
            waited = time.monotonic() - started
        finally:
            second_transfer.stop()
    assert out == reference and cached == 0
    assert 0.5 <= waited < 5.0, f"the probe's timeout bounded the wait: {waited:.2f}s"


def closed_address() -> str:
    """An address on 127.0.0.1 where nothing listens (a server started, then stopped)."""
    server = BlockServer(BlockHolder(1, 1.0), "127.0.0.1")
    server.start()
    server.stop()
    return f"127.0.0.1:{server.port}"


@pytest.mark.parametrize("mappable", [True, False])
def test_blocks_held_in_a_pool_are_copied_from_it_or_pulled_over_tcp(
        folder: Path, pooled: tuple[LLMEngine, TcpTransfer, str, SlotPool],
        monkeypatch: pytest.MonkeyPatch, mappable: bool) -> None:
    first, first_transfer, source, pool = pooled
    reference, _ = run(first, prompt(), "p")
    assert first_transfer.flush(10)
    holder = first_transfer.holder
    assert holder is not None
    held = holder.stats.held_blocks
    assert held >= 5 and pool.free_slots == pool.slots - held
    hashes = hash_blocks(prompt(), BLOCK)
    computed = {h: cached_bytes(first, h) for h in hashes}
    if not mappable:  # as on another host: the pool's handle cannot be opened
        monkeypatch.setattr(tcp_handoff, "map_pool", lambda handle, device: None)

    second, second_transfer = make_engine(folder, None)
    try:
        second_transfer.expect("d", source)
        out, cached = run(second, prompt(), "d")
        assert second_transfer.mapped_sources == ([source] if mappable else [])
        # A prompt the source never held: the probe misses, and the pool is let go of.
        second_transfer.expect("e", source)
        _, cached_other = run(second, [t + 1 for t in prompt()], "e")
        assert cached_other == 0 and second_transfer.stats.failed_pulls == 1
        assert second_transfer.mapped_sources == []
    finally:
        second_transfer.stop()
    assert out == reference and cached == 5 * BLOCK
    assert second_transfer.stats.pulled_blocks == 5
    assert second_transfer.stats.mapped_blocks == (5 if mappable else 0)
    for h in hashes:
        assert cached_bytes(second, h) == computed[h], "a copied block is not bit-exact"
    assert holder.stats.pulled_blocks == 5
    assert pool.free_slots == pool.slots - (held - 5), "the copied blocks' slots came back"


class SlowStore:
    """A kvstore transport that has fallen far behind: it takes no saves."""

    available = True
    save_backlog_bytes = 1 << 40

    def __init__(self) -> None:
        self.saves = 0

    def may_hold(self, request_id: str) -> bool:
        return False

    def submit(self, job: object) -> None:
        self.saves += 1

    def take_done(self) -> list[object]:
        return []

    def wait(self, timeout_s: float) -> None:
        pass


def test_a_kvstore_far_behind_does_not_stop_the_handoff(folder: Path) -> None:
    """A prefill worker's saves are held for the handoff even when its kvstore is more than
    its backlog bound behind: the store's copies are dropped (counted), the handoff's kept."""
    store = SlowStore()
    holder = BlockHolder(1 << 30, 60.0)
    config = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
                          block_size=BLOCK, max_model_len=256)
    made: list[TcpTransfer] = []

    def transport(kv_caches: KVCaches) -> TcpTransfer:
        made.append(TcpTransfer(kv_caches, inner=store, holder=holder,  # type: ignore[arg-type]
                                store_backlog_bytes=1 << 20))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, 1 << 20))
    made[0].start()
    try:
        run(engine, prompt(), "p")
        assert made[0].flush(10)
    finally:
        made[0].stop()
    held = holder.num_held(hash_blocks(prompt(), BLOCK))
    assert held == 5, "every prompt block is held for the handoff"
    assert store.saves == 0 and made[0].stats.dropped_store_saves >= 5
