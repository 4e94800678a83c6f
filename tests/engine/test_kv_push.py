"""Pushing a prompt's KV into the decode worker's pool layer by layer (tier/kv_push.py), between
two engines on a tiny model on a CPU (shared-memory pools, real sockets): the prefill engine
reserves slots of the decode worker's pool before it admits the request, writes each layer's
rows of the completed blocks into them as that layer's kernels run (the later layers' rows
are still untouched then), and commits them when sent; the decode engine finds them at its
own listener and copies them from its own pool, bit-exact, and its tokens equal the prefill
engine's own continuation. Blocks the prefill engine already had cached are pushed whole
when the reservation is granted; a decode worker without room refuses, and the prefill
engine then holds the blocks itself as without a target."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from meshserve.services.worker.tier.kv_tier import SaveJob
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.sampling_params import SamplingParams

BLOCK = 8
PROMPT_BLOCKS = 5


@dataclass
class Side:
    engine: LLMEngine
    transfer: TcpTransfer
    address: str
    pool: SlotPool
    holder: BlockHolder
    server: BlockServer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-kv-push"), "llama", seed=9)


def make_side(folder: Path, role: str, pool_bytes: int = 8 << 20,
              watch: Callable[[Callable[[int], None]], Callable[[int], None]] | None = None
              ) -> Side:
    """A prefill engine (holds what it does not push) or a decode engine (its listener takes
    pushes into its pool), as the worker's link wires them; `watch` wraps the pusher's
    per-layer call."""
    pool = SlotPool(pool_bytes, torch.device("cpu"))
    holder = BlockHolder(1 << 30, 60.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    config = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
                          block_size=BLOCK, max_model_len=256)
    made: list[TcpTransfer] = []

    def transport(kv_caches: KVCaches) -> TcpTransfer:
        made.append(TcpTransfer(kv_caches, holder=holder if role == "prefill" else None,
                                pool=pool, streams=2, timeout_s=5.0, push=role == "prefill"))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, 1 << 30))
    transfer, address = made[0], f"127.0.0.1:{server.port}"
    if transfer.pusher is not None:
        tier = tier_of(engine)
        assert tier is not None
        if watch is not None:
            transfer.pusher.layer_written = watch(  # type: ignore[method-assign]
                transfer.pusher.layer_written)
        transfer.pusher.attach(engine.watch_layers, tier)
    else:
        transfer.own_address, transfer.received = address, holder
    transfer.start()
    return Side(engine, transfer, address, pool, holder, server)


def close(side: Side) -> None:
    side.transfer.stop()
    side.server.stop()


@pytest.fixture
def sides(folder: Path) -> Iterator[tuple[Side, Side]]:
    prefill, decode = make_side(folder, "prefill"), make_side(folder, "decode")
    try:
        yield prefill, decode
    finally:
        close(prefill)
        close(decode)


def prompt(seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(PROMPT_BLOCKS * BLOCK + 3)]


def run(engine: LLMEngine, tokens_in: list[int], rid: str, max_tokens: int = 4
        ) -> tuple[list[int], int]:
    engine.add_request(rid, tokens_in, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))
    outputs = drain(engine)[(rid, 0)]
    return tokens(outputs), outputs[-1].num_cached_tokens


def cached_bytes(engine: LLMEngine, block_hash: bytes) -> bytes:
    block = engine.kv.pool.get_cached_block(block_hash)
    assert block is not None
    return torch.stack([torch.stack([k[block.block_id], v[block.block_id]])
                        for k, v in engine.runner.kv_caches]).numpy().tobytes()


def hand_off(prefill: Side, decode: Side, rid: str, tokens_in: list[int]) -> str:
    """Prefill `rid` pushing to `decode`, then send it: the kv_source it names."""
    assert prefill.transfer.pusher is not None
    prefill.transfer.pusher.target(rid, decode.address)
    run(prefill.engine, tokens_in, rid, max_tokens=1)
    assert prefill.transfer.flush(10)
    return prefill.transfer.commit(rid) or prefill.address


@pytest.mark.parametrize("layers,per_push", [(2, 1), (4, 2)], ids=["each-layer", "runs-of-2"])
def test_pushed_blocks_decode_as_the_prefill_engine_continues(
        tmp_path: Path, layers: int, per_push: int) -> None:
    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=9, num_hidden_layers=layers)
    decode = make_side(folder, "decode")
    snapshots: list[tuple[int, torch.Tensor]] = []

    def watch(written: Callable[[int], None]) -> Callable[[int], None]:
        def watched(index: int) -> None:  # what the decode pool holds right after layer i
            written(index)
            snapshots.append((index, decode.pool.data.clone()))
        return watched

    prefill = make_side(folder, "prefill", watch=watch)
    assert prefill.transfer.pusher is not None
    prefill.transfer.pusher.layers_per_push = per_push
    try:
        check_push(prefill, decode, snapshots, per_push)
    finally:
        close(prefill)
        close(decode)


def check_push(prefill: Side, decode: Side, snapshots: list[tuple[int, torch.Tensor]],
               per_push: int) -> None:
    pusher = prefill.transfer.pusher
    assert pusher is not None
    layers = len(prefill.engine.runner.kv_caches)
    source = hand_off(prefill, decode, "p", prompt())
    assert source.startswith(decode.address + "#"), "the blocks wait in the decode pool"
    assert pusher.stats.pushed_blocks == PROMPT_BLOCKS
    hashes = hash_blocks(prompt(), BLOCK)[:PROMPT_BLOCKS]
    assert prefill.holder.num_held(hashes) == 0, "pushed blocks are not also held"
    reference, _ = run(prefill.engine, prompt(), "again")  # its own cache, all hits

    decode.transfer.expect("d", source)
    out, cached = run(decode.engine, prompt(), "d")
    assert out == reference and cached == PROMPT_BLOCKS * BLOCK
    stats = decode.transfer.stats
    assert stats.mapped_blocks == PROMPT_BLOCKS and stats.pulled_blocks == PROMPT_BLOCKS
    for h in hashes:
        assert cached_bytes(decode.engine, h) == cached_bytes(prefill.engine, h), \
            "a pushed block is not bit-exact"
    assert decode.pool.free_slots == decode.pool.slots, "the loaded slots came back"

    # Layer by layer: in the prefill step (the first forward since the pusher was attached),
    # right after the last layer of each run of `per_push` layers the pushed slots hold
    # their final bytes up to it, and the later layers are still untouched.
    step = snapshots[:layers]
    assert [i for i, _ in step] == list(range(layers))
    final = step[-1][1].view(decode.pool.slots, layers, 2, -1)
    touched = final.flatten(2).any(dim=2).all(dim=1).nonzero().flatten()
    assert len(touched) == PROMPT_BLOCKS
    for index, snap in step:
        rows = snap.view(final.shape)[touched]
        done = (index + 1) // per_push * per_push  # the layers of the runs finished
        assert torch.equal(rows[:, :done], final[touched][:, :done])
        assert not rows[:, done:].any(), f"layer {done} was there before its run ended"


def test_blocks_cached_before_the_request_are_pushed_when_granted(
        sides: tuple[Side, Side]) -> None:
    prefill, decode = sides
    reference, _ = run(prefill.engine, prompt(3), "warm")  # cached on the prefill side
    source = hand_off(prefill, decode, "p", prompt(3))
    assert source.startswith(decode.address + "#")
    assert prefill.transfer.pusher is not None
    assert prefill.transfer.pusher.stats.pushed_blocks == PROMPT_BLOCKS
    decode.transfer.expect("d", source)
    out, cached = run(decode.engine, prompt(3), "d")
    assert out == reference and cached == PROMPT_BLOCKS * BLOCK
    assert decode.transfer.stats.mapped_blocks == PROMPT_BLOCKS


def test_a_decode_worker_without_room_refuses_and_the_blocks_are_held(folder: Path) -> None:
    prefill = make_side(folder, "prefill")
    # Room for fewer slots than the prompt has blocks.
    block_bytes = prefill.transfer.block_bytes
    decode = make_side(folder, "decode", pool_bytes=64 + 2 * block_bytes)
    try:
        source = hand_off(prefill, decode, "p", prompt(6))
        pusher = prefill.transfer.pusher
        assert pusher is not None and pusher.stats.refused_reservations == 1
        assert pusher.stats.pushed_blocks == 0 and source == prefill.address
        assert decode.pool.free_slots == decode.pool.slots, "a refusal keeps no slot"
        hashes = hash_blocks(prompt(6), BLOCK)[:PROMPT_BLOCKS]
        assert prefill.holder.num_held(hashes) == PROMPT_BLOCKS
        decode.transfer.expect("d", source)
        out, cached = run(decode.engine, prompt(6), "d")
        expected, _ = run(prefill.engine, prompt(6), "again")
        assert out == expected and cached == PROMPT_BLOCKS * BLOCK
        assert decode.transfer.stats.mapped_blocks == PROMPT_BLOCKS  # from the prefill pool
    finally:
        close(prefill)
        close(decode)


def test_a_request_ended_unsent_gives_its_slots_back(sides: tuple[Side, Side]) -> None:
    prefill, decode = sides
    pusher = prefill.transfer.pusher
    assert pusher is not None
    pusher.target("p", decode.address)
    prefill.engine.add_request("p", prompt(4), SamplingParams(temperature=0.0, max_tokens=1))
    # Asked for as the request is added, before any step (not when it is first scheduled).
    assert prefill.transfer.flush(10)
    assert decode.server.pending is not None and len(decode.server.pending) == PROMPT_BLOCKS
    drain(prefill.engine)
    assert prefill.transfer.flush(10)
    assert decode.pool.free_slots == decode.pool.slots - PROMPT_BLOCKS, "reserved, written"
    assert decode.server.pending is not None and len(decode.server.pending) == PROMPT_BLOCKS
    pusher.forget("p")  # aborted before it was sent (the session forgets it)
    run(prefill.engine, prompt(8)[:5], "next", max_tokens=1)  # the next step releases
    assert prefill.transfer.flush(10)
    assert len(decode.server.pending) == 0
    assert decode.pool.free_slots == decode.pool.slots
    assert prefill.transfer.commit("p") == "", "nothing is left to send"


def test_a_prefill_engines_saves_say_whose_blocks_they_hold(folder: Path) -> None:
    """What sending waits for (tcp_handoff.py's `flush_request`): the saves of the request's
    own blocks."""
    prefill = make_side(folder, "prefill")
    owners: list[frozenset[str]] = []
    submit = prefill.transfer.submit

    def recorded(job: object) -> None:
        if isinstance(job, SaveJob):
            owners.append(job.owners)
        submit(job)  # type: ignore[arg-type]

    prefill.transfer.submit = recorded  # type: ignore[method-assign]
    try:
        run(prefill.engine, prompt(9), "own", max_tokens=1)
        assert owners and set().union(*owners) == {"own"}
        assert prefill.transfer.flush_request("own", 10)
        hashes = hash_blocks(prompt(9), BLOCK)[:PROMPT_BLOCKS]
        assert prefill.holder.num_held(hashes) == PROMPT_BLOCKS
    finally:
        close(prefill)
