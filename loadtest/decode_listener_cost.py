"""What a decode worker's KV listener costs its decode steps when prompts are pushed to it.

    python loadtest/decode_listener_cost.py --model loadtest/models/llama-3.1-8b \
        --device cuda:0 --out listener_cost.json

With `--kv-handoff ipc --kv-handoff-push` a decode worker's listener (services/worker/tier/
tcp_blocks.py: BlockServer, PendingSlots, BlockHolder) answers each pushed request's
RESERVE and COMMIT on threads of the decode worker's process, beside the engine thread that
launches its decode steps. This script runs that engine (dummy weights of `--model`'s
config, CUDA graphs as configured) with `--streams` sequences decoding, and that listener
over a pool on the same device. A child process plays the prefill worker: `--rate` requests
a second, each of `--min-blocks` to `--max-blocks` blocks, reserved when it arrives and
committed when the next one arrives; a thread here takes each committed request's blocks
`--take-after-s` later and gives their slots back (as the decode worker's load does).

Reported: the decode steps' wall times (ms: p50, p90, p99, max) in windows of `--phase-s`
seconds with the child quiet and sending, `--cycles` of each taken in turn (the sequences'
growing context lengthens later steps alike on both sides); and the pushed requests and
blocks. The difference is what the listener's work in this process costs the decode steps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.tcp_blocks import HASH_BYTES, BlockHolder, BlockServer
from meshserve.services.worker.tier.tcp_blocks import commit as commit_blocks
from meshserve.services.worker.tier.tcp_blocks import reserve as reserve_blocks
from meshserve.shared.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts
from handoff_send_wait import summary

BLOCK = 16


def block_bytes(model: str) -> int:
    """One 16-token block of the model's KV in bf16."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * 2 * BLOCK


def prefill_side(address: str, args: argparse.Namespace, conn: Connection) -> None:
    """The child: while sending ("go" to "pause"), reserve each request's blocks as it
    arrives, commit them when the next arrives, and send their keys to the taker; on
    "stop", its totals."""
    rng = random.Random(args.seed)
    previous: list[bytes] = []
    requests = blocks = refused = 0
    conn.send("ready")
    sending, next_at = False, time.monotonic()
    while True:
        if conn.poll(max(0.0, next_at - time.monotonic()) if sending else None):
            message = conn.recv()
            if message == "stop":
                break
            sending, next_at = message == "go", time.monotonic()
            continue
        next_at += 1.0 / args.rate
        keys = [os.urandom(HASH_BYTES)
                for _ in range(rng.randint(args.min_blocks, args.max_blocks))]
        granted = reserve_blocks(address, keys, 1.0)
        if previous:
            commit_blocks(address, previous, 1.0)
            conn.send(previous)
        previous = keys if granted is not None else []
        refused += granted is None
        requests += granted is not None
        blocks += len(keys) if granted is not None else 0
    conn.send((requests, blocks, refused))


def take_loop(holder: BlockHolder, conn: Connection, delay_s: float,
              stop: threading.Event, totals: list[int]) -> None:
    """The decode worker's loads: each committed request's blocks taken `delay_s` later,
    their slots given back; the child's totals, its last message, into `totals`."""
    while not stop.is_set():
        if not conn.poll(0.1):
            continue
        keys = conn.recv()
        if isinstance(keys, tuple):
            totals.extend(keys)
            return
        time.sleep(delay_s)
        taken = holder.take(keys)
        if taken is not None:
            holder.give_back(taken)


def decode_steps(engine: LLMEngine, seconds: float) -> list[float]:
    """Wall times (ms) of the engine's steps over `seconds`."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    last = time.perf_counter()
    while last < end:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the streams ended before the phase: raise --max-model-len")
        engine.step()
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    return times


def measure(args: argparse.Namespace) -> dict[str, Any]:
    pool = SlotPool(args.pool_bytes, torch.device(args.device))
    try:
        pool.carve(block_bytes(args.model))
        return measure_with(pool, args)
    finally:
        pool.close()


def measure_with(pool: SlotPool, args: argparse.Namespace) -> dict[str, Any]:
    holder = BlockHolder(args.pool_bytes, 30.0, release=pool.release)
    server = BlockServer(holder, "127.0.0.1", pool=pool)
    server.start()
    config = EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16",
                          device=args.device, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    engine = build_engine(config)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_model_len - args.prompt_len,
                            ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"d{i}", [rng.randrange(10, vocab - 10)
                                     for _ in range(args.prompt_len)], params)
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=prefill_side,
                            args=(f"127.0.0.1:{server.port}", args, child), daemon=True)
    stop = threading.Event()
    totals: list[int] = []
    taker = threading.Thread(target=take_loop, daemon=True,
                             args=(holder, parent, args.take_after_s, stop, totals))
    process.start()
    assert parent.recv() == "ready"
    taker.start()
    quiet: list[float] = []
    pushed: list[float] = []
    try:
        decode_steps(engine, args.warmup_s)  # the prompts, and the steps' warm-up
        # Windows taken in turn: the sequences' growing context slows the later steps,
        # and both sides see it alike.
        for _ in range(args.cycles):
            quiet += decode_steps(engine, args.phase_s)
            parent.send("go")
            pushed += decode_steps(engine, args.phase_s)
            parent.send("pause")
    finally:
        parent.send("stop")
        taker.join(timeout=30)
        stop.set()
        process.join(timeout=30)
        server.stop()
    requests, blocks, refused = totals or [0, 0, 0]
    return {"steps_without_pushes_ms": summary(quiet), "steps_with_pushes_ms": summary(pushed),
            "pushed_requests": requests, "pushed_blocks": blocks, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (its config.json)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--max-model-len", type=int, default=8448)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--pool-bytes", type=int, default=8 << 30)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=7.0)
    parser.add_argument("--min-blocks", type=int, default=128)
    parser.add_argument("--max-blocks", type=int, default=512)
    parser.add_argument("--take-after-s", type=float, default=0.03)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--phase-s", type=float, default=3.0)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--switch-interval-ms", type=float, default=0.0,
                        help="the interpreter's thread switch interval here (0: Python's, "
                             "5 ms)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, **measure(args),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
              "torch": torch.__version__, "python": platform.python_version()}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
