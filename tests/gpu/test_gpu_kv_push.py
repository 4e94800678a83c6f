"""The prompt's KV pushed GPU to GPU layer by layer (--kv-handoff ipc, tier/kv_push.py): a
decode engine in this process (on the second GPU when there are two) takes pushes into a pool
on its GPU served by its listener; a prefill engine in a process of its own, with CUDA graphs
(its prompt runs in piecewise-graph steps, the per-layer call made between the pieces),
reserves slots there, writes each layer's rows of the prompt's blocks into them through
CUDA IPC on a stream of its own as the layers run, and commits them. The decode engine loads
them from its own pool: its greedy tokens equal the prefill engine's, every prompt block is
bit-exact, every block was pushed and none pulled over TCP, and the slots went back.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from test_gpu_ipc_handoff import BLOCK, BLOCKS, block_bytes, prompt, run
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.tier.kv_tier import KVTier
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer
from meshserve.shared.block_hash import hash_blocks


def make_engine(folder: Path, device: str, pool: SlotPool, holder: BlockHolder | None,
                *, push: bool) -> tuple[LLMEngine, TcpTransfer]:
    config = EngineConfig(model=str(folder), dtype="bfloat16", device=device,
                          num_kv_blocks=128, block_size=BLOCK, max_model_len=512,
                          enforce_eager=not push, max_num_seqs=4)
    made: list[TcpTransfer] = []

    def transport(kv_caches: KVCaches) -> TcpTransfer:
        made.append(TcpTransfer(kv_caches, holder=holder, pool=pool, timeout_s=30.0,
                                push=push))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, 1 << 30))
    transfer = made[0]
    if transfer.pusher is not None:
        tier = engine.hook(KVTier)
        assert tier is not None
        transfer.pusher.attach(engine.watch_layers, tier)
    transfer.start()
    return engine, transfer


def prefill_side(folder: Path, device: str, target: str, conn: Connection) -> None:
    """The prefill worker's part, in its own process: push, commit, report."""
    pool = SlotPool(64 << 20, torch.device(device))
    holder = BlockHolder(1 << 30, 120.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    engine, transfer = make_engine(folder, device, pool, holder, push=True)
    assert transfer.pusher is not None
    transfer.pusher.target("p", target)
    tokens, _ = run(engine, "p")
    assert transfer.flush(30)
    source = transfer.commit("p")
    conn.send((source, tokens, block_bytes(engine, hash_blocks(prompt(), BLOCK)),
               transfer.pusher.stats.pushed_blocks, holder.stats.held_blocks,
               engine.runner.pieces is not None))
    conn.recv()
    server.stop()
    transfer.stop()


def test_prompt_blocks_pushed_gpu_to_gpu_layer_by_layer(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=9)
    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    pool = SlotPool(64 << 20, torch.device(decode_device))
    holder = BlockHolder(1 << 30, 120.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    engine, transfer = make_engine(folder, decode_device, pool, None, push=False)
    address = f"127.0.0.1:{server.port}"
    transfer.own_address, transfer.received = address, holder
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=prefill_side, args=(folder, "cuda:0", address, child),
                            daemon=True)
    process.start()
    try:
        assert parent.poll(600), "the prefill process did not report"
        source, reference, computed, pushed, held, piecewise = parent.recv()
        assert source.startswith(address + "#"), f"not pushed here: {source!r}"
        transfer.expect("d", source)
        tokens, cached = run(engine, "d")
        copied = block_bytes(engine, hash_blocks(prompt(), BLOCK))
        stats = transfer.stats
        parent.send("stop")
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
        transfer.stop()
        server.stop()
    assert piecewise, "the prefill engine ran without piecewise graphs"
    assert pushed == BLOCKS and held == 0, "every prompt block was pushed, none held"
    assert tokens == reference, "KV pushed GPU to GPU gave different tokens"
    assert cached == BLOCKS * BLOCK
    assert stats.mapped_blocks == BLOCKS and stats.pulled_bytes == BLOCKS * transfer.block_bytes
    assert copied == computed, "a block pushed through CUDA IPC is not bit-exact"
    assert pool.free_slots == pool.slots, "the loaded slots went back to the pool"
