"""A long prompt's first token, recomputed against loaded from the kvstore.

Driver part: `kv` (KV_PARTS=load).

    python loadtest/kv_tier_load.py --out loadtest/reports/cpu/kv_tier_load.json   # CPU, SmolLM2
    python loadtest/kv_tier_load.py --device cuda --prefix-len 8192 --out $OUT/kv_tier_load.json

One engine in process (on the GPU: the Llama-3.1-8B shape, dummy bf16 weights) with its KV
tier attached to a real kvstore process on this host (shared memory). For each of `--iters`
fresh `--prefix-len`-token prompts: TTFT computing it (cold: no cache anywhere; its blocks are
saved to the store meanwhile), then, with the engine's own prefix cache cleared, TTFT again:
its blocks now come from the store. Both runs must produce the same first tokens. Also
reports the store's load rate (bytes loaded / seconds of the transfer thread's loads) next to
this device's host-to-device copy rate from pinned and from pageable memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.tier.kv_tier import KVTier
from meshserve.services.worker.tier.store_client import KVStoreClient
from meshserve.services.worker.tier.transfer import KVTransfer
from meshserve.shared.sampling_params import SamplingParams

_LLAMA_8B = Path(__file__).resolve().parent / "models" / "llama-3.1-8b"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_kvstore(capacity: int, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A kvstore process on a free port, once its health check says SERVING."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "meshserve.services.kvstore", "--host", "127.0.0.1", "--port",
         str(port), "--capacity-bytes", str(capacity), "--redis-url", "",
         "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT)
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kvstore exited with {process.returncode}; see {log_path}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return process, address
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("kvstore did not become SERVING within 60 s")
            time.sleep(0.2)  # polling a child process's health: no event to wait on


def ttft(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds from add to the first token, and the request's tokens (engine idle after)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first: float | None = None
    out: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.new_token_ids and first is None:
                first = time.perf_counter() - started
            out.extend(output.new_token_ids)
    assert first is not None
    return first, out


def drain_saves(transfer: KVTransfer) -> None:
    """Until every save submitted so far is in the store."""
    if not transfer.flush(600):
        raise RuntimeError("saves did not finish in 600 s")


def copy_rates(device: torch.device, nbytes: int) -> dict[str, float]:
    """Host-to-device GB/s from pinned and from pageable memory (one copy of `nbytes`)."""
    if device.type != "cuda":
        return {}
    rates: dict[str, float] = {}
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, pinned in (("pinned", True), ("pageable", False)):
        source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        source.fill_(1)
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
        rates[f"h2d_{name}_gb_s"] = nbytes / best / 1e9
    return rates


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2 on a "
                        "CPU, the Llama-3.1-8B shape with dummy weights on a GPU)")
    parser.add_argument("--prefix-len", type=int, default=None,
                        help="prompt tokens (default: 8192 on a GPU, 2048 on a CPU)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--capacity-bytes", type=int, default=8 << 30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def reset_prefix_cache(engine: LLMEngine) -> None:
    """Forget the engine's own prefix cache (the engine idle), so that the next request's
    blocks come from the store. No engine fact does this: the KV cache manager's pool."""
    assert engine.kv.pool.reset_prefix_cache(), "engine not idle"


def _warm_up(engine: LLMEngine, transfer: KVTransfer) -> None:
    ttft(engine, "warm", [11] * 64, 2)
    # One small save and load first: the first load of a process pays one-time costs
    # (measured once at 0.86 s for 8k tokens on an H100, against 0.06 s after).
    warm = [13] * (4 * engine.block_size + 1)
    ttft(engine, "warm-save", warm, 1)
    drain_saves(transfer)
    reset_prefix_cache(engine)
    ttft(engine, "warm-load", warm, 1)
    reset_prefix_cache(engine)


def _trial(engine: LLMEngine, transfer: KVTransfer, tier: KVTier, name: str,
           prompt: list[int], max_tokens: int) -> dict[str, float]:
    """Time to first token of `prompt` computed, then loaded back from the tier."""
    computed_s, computed = ttft(engine, f"c{name}", prompt, max_tokens)
    drain_saves(transfer)
    reset_prefix_cache(engine)
    before = (tier.stats.loaded_blocks, transfer.stats.loaded_bytes,
              transfer.stats.load_seconds)
    loaded_s, loaded = ttft(engine, f"l{name}", prompt, max_tokens)
    blocks = tier.stats.loaded_blocks - before[0]
    assert loaded == computed, f"trial {name}: loaded KV gave different tokens"
    reset_prefix_cache(engine)
    return {
        "ttft_recompute_ms": computed_s * 1000, "ttft_loaded_ms": loaded_s * 1000,
        "ratio": loaded_s / computed_s, "loaded_blocks": blocks,
        "loaded_gb": (transfer.stats.loaded_bytes - before[1]) / 1e9,
        "load_gb_s": (transfer.stats.loaded_bytes - before[1])
        / max(transfer.stats.load_seconds - before[2], 1e-9) / 1e9}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    prefix_len = args.prefix_len or (8192 if on_gpu else 2048)
    model = args.model or (str(_LLAMA_8B) if on_gpu else None)
    config = EngineConfig(
        model=model, load_format="dummy" if on_gpu and args.model is None else "auto",
        device=args.device, max_model_len=prefix_len + 256,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    store, address = start_kvstore(args.capacity_bytes, args.out.with_suffix(".kvstore.log"))
    try:
        made: list[KVTransfer] = []

        def transport(kv_caches: KVCaches) -> KVTransfer:
            # The client is made when the transfer starts (below), once the engine is built
            # and `namespace` (its dtype) is known.
            made.append(KVTransfer(lambda: KVStoreClient(address, namespace), kv_caches))
            return made[0]

        engine = build_engine(config, kv_tier=KVTierPlan(transport, 64 << 30))
        namespace = f"bench@{str(engine.dtype).removeprefix('torch.')}"
        transfer = made[0]
        transfer.start()
        if not transfer.available:
            raise RuntimeError(f"cannot reach the kvstore at {address}")
        tier = engine.hook(KVTier)
        assert tier is not None
        vocab = engine.model_config.vocab_size
        _warm_up(engine, transfer)
        rng = random.Random(0)
        trials = []
        for i in range(args.iters):
            prompt = [rng.randrange(10, vocab - 10) for _ in range(prefix_len)]
            trials.append(_trial(engine, transfer, tier, str(i), prompt, args.max_tokens))
            print(json.dumps(trials[-1]), flush=True)
        block_bytes = transfer.stats.loaded_bytes // max(tier.stats.loaded_blocks, 1)
        result = {
            "prefix_len": prefix_len, "block_size": engine.block_size,
            "block_bytes": block_bytes, "shared_memory": transfer._client.shared_memory
            if transfer._client is not None else False,
            "trials": trials,
            "median_ratio": sorted(t["ratio"] for t in trials)[len(trials) // 2],
            **copy_rates(engine.device, 1 << 30),
            "device": torch.cuda.get_device_name(engine.device) if on_gpu else platform.processor(),
            "torch": torch.__version__, "command": " ".join(["python", *sys.argv]),
            "model": engine.source.name, "dtype": str(engine.dtype),
            "cpu_count": os.cpu_count()}
        transfer.stop()
    finally:
        store.terminate()
        store.wait(30)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
