"""The KV handoff GPU to GPU (--kv-handoff ipc, services/worker/tier/slot_pool.py): a prefill
engine in a process of its own holds a prompt's blocks in a pool on its GPU; a decode
engine in this process, on the other GPU when there are two (the same one otherwise), maps
that pool through CUDA IPC, leases the blocks and gathers them into its cache. Its greedy
tokens equal the prefill engine's, every prompt block is bit-exact, every block came
through the mapped pool (none over TCP), and the slots went back to the pool.
"""

from __future__ import annotations

import multiprocessing
import random
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.sampling_params import SamplingParams

BLOCK = 16
BLOCKS = 9


def prompt() -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(3, 200) for _ in range(BLOCKS * BLOCK + 5)]


def make_engine(folder: Path, device: str, holder: BlockHolder | None,
                pool: SlotPool | None) -> tuple[LLMEngine, TcpTransfer]:
    config = EngineConfig(model=str(folder), dtype="bfloat16", device=device,
                          num_kv_blocks=128, block_size=BLOCK, max_model_len=512,
                          enforce_eager=True)
    made: list[TcpTransfer] = []

    def transport(kv_caches: KVCaches) -> TcpTransfer:
        made.append(TcpTransfer(kv_caches, holder=holder, pool=pool, timeout_s=30.0))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, 1 << 30))
    made[0].start()
    return engine, made[0]


def run(engine: LLMEngine, rid: str) -> tuple[list[int], int]:
    engine.add_request(rid, prompt(), SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True))
    out: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
            cached = o.num_cached_tokens
    return out, cached


def block_bytes(engine: LLMEngine, hashes: list[bytes]) -> list[bytes]:
    rows = []
    for h in hashes:
        block = engine.kv.pool.get_cached_block(h)
        assert block is not None
        rows.append(torch.stack([torch.stack([k[block.block_id], v[block.block_id]])
                                 for k, v in engine.runner.kv_caches]).cpu().view(
                                     torch.uint8).numpy().tobytes())
    return rows


def prefill_side(folder: Path, device: str, conn: Connection) -> None:
    """The prefill worker's part, in its own process: hold, serve, report, wait."""
    pool = SlotPool(64 << 20, torch.device(device))
    holder = BlockHolder(1 << 30, 120.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    engine, transfer = make_engine(folder, device, holder, pool)
    tokens, _ = run(engine, "p")
    assert transfer.flush(30)
    conn.send((f"127.0.0.1:{server.port}", tokens, block_bytes(engine, hash_blocks(
        prompt(), BLOCK)), holder.stats.held_blocks, pool.slots))
    conn.recv()  # the decode side is done
    conn.send(pool.free_slots)
    conn.recv()
    server.stop()
    transfer.stop()


def test_prompt_blocks_copied_gpu_to_gpu_through_cuda_ipc(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=9)
    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=prefill_side, args=(folder, "cuda:0", child), daemon=True)
    process.start()
    try:
        assert parent.poll(300), "the prefill process did not report"
        source, reference, computed, held, slots = parent.recv()
        engine, transfer = make_engine(folder, decode_device, None, None)
        transfer.expect("d", source)
        tokens, cached = run(engine, "d")
        copied = block_bytes(engine, hash_blocks(prompt(), BLOCK))
        stats = transfer.stats
        transfer.stop()
        parent.send("done")
        free_after = parent.recv()
        parent.send("stop")
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    assert tokens == reference, "KV copied GPU to GPU gave different tokens"
    assert cached == BLOCKS * BLOCK
    assert stats.mapped_blocks == BLOCKS and stats.pulled_blocks == BLOCKS
    assert copied == computed, "a block copied through CUDA IPC is not bit-exact"
    assert free_after == slots - (held - BLOCKS), "the leased slots went back to the pool"
