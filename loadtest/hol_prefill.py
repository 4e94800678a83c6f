"""Short requests while one long prompt is prefilled on the same engine: TTFT and ITL.

Driver part: none (run by hand on CPU or GPU; cited by docs/operations.md).

    python loadtest/hol_prefill.py --out loadtest/reports/cpu/hol_prefill.json   # SmolLM2, CPU
    python loadtest/hol_prefill.py --device cuda --out $OUT/hol_prefill.json     # 8B shape, GPU

In process, on one engine: `--decodes` short requests (random 32-token prompts, greedy,
`ignore_eos`) are decoding when one `--long-len`-token prompt arrives; from then on a new
short request arrives every `--arrival-ms` until the long prompt has its first token. For
each value of `--long-prefill-token-threshold` (0: no cap) it reports the long prompt's
TTFT, the TTFT of the short requests that arrived during its prefill, and the inter-token
latency of the decodes over the same window (p50, p99, max). On the GPU the model is the
Llama-3.1-8B shape with dummy bf16 weights (loadtest/models/llama-3.1-8b).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.sampling_params import SamplingParams

_LLAMA_8B = Path(__file__).resolve().parent / "models" / "llama-3.1-8b"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def _summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"count": len(ms), "p50_ms": _percentile(ms, 0.5), "p99_ms": _percentile(ms, 0.99),
            "max_ms": max(ms, default=float("nan"))}


def run(engine: LLMEngine, vocab: int, *, decodes: int, long_len: int, arrival_s: float,
        seed: int) -> dict[str, object]:
    """One trial; the engine must be idle before and is idle after."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    short = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)  # outlive the trial
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    for i in range(decodes):
        submitted[f"d{i}"] = time.perf_counter()
        engine.add_request(f"d{i}", prompt(32), short)
    while len(first) < decodes:  # every decode has started
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    long_at = time.perf_counter()
    engine.add_request("long", prompt(long_len), SamplingParams(temperature=0.0, max_tokens=1))
    arrivals = 0
    next_arrival = long_at
    while "long" not in first:
        now = time.perf_counter()
        if now >= next_arrival:
            rid = f"a{arrivals}"
            arrivals += 1
            submitted[rid] = now
            engine.add_request(rid, prompt(32), short)
            next_arrival = now + arrival_s
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id.startswith("d") and out.new_token_ids:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
            first.setdefault(out.request_id, now)
    long_ttft = first["long"] - long_at
    # The arrivals still waiting for a first token get it now (their TTFT counts too).
    waiting = {f"a{i}" for i in range(arrivals)} - set(first)
    while waiting:
        for out in engine.step():
            if out.request_id in waiting:
                first[out.request_id] = time.perf_counter()
                waiting.discard(out.request_id)
    for rid in [*[f"d{i}" for i in range(decodes)], *[f"a{i}" for i in range(arrivals)]]:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    ttfts = [first[f"a{i}"] - submitted[f"a{i}"] for i in range(arrivals)]
    return {"long_ttft_ms": long_ttft * 1000, "arrivals": arrivals,
            "short_ttft": _summary(ttfts), "decode_itl": _summary(gaps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None,
                        help="model (default: SmolLM2-135M-Instruct on CPU, the dummy 8B shape "
                             "on CUDA)")
    parser.add_argument("--long-len", type=int, default=None,
                        help="tokens of the long prompt (default: 4096 CPU, 16384 CUDA)")
    parser.add_argument("--decodes", type=int, default=None,
                        help="requests decoding when it arrives (default: 8 CPU, 64 CUDA)")
    parser.add_argument("--arrival-ms", type=float, default=None,
                        help="a new short request every this often (default: 250 CPU, 20 CUDA)")
    parser.add_argument("--thresholds", type=int, nargs="+", default=None,
                        help="--long-prefill-token-threshold values (default: 0 256 512 CPU, "
                             "0 512 2048 CUDA)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    long_len = args.long_len or (16384 if gpu else 4096)
    decodes = args.decodes or (64 if gpu else 8)
    arrival_s = (args.arrival_ms or (20.0 if gpu else 250.0)) / 1000
    thresholds = args.thresholds or ([0, 512, 2048] if gpu else [0, 256, 512])
    model = args.model or (str(_LLAMA_8B) if gpu else None)
    results = []
    for threshold in thresholds:
        config = EngineConfig(
            model=model, load_format="dummy" if gpu and args.model is None else "auto",
            dtype="bfloat16" if gpu else "float32", device=args.device,
            max_model_len=long_len + 1024, long_prefill_token_threshold=threshold)
        engine = build_engine(config)
        vocab = engine.model_config.vocab_size
        run(engine, vocab, decodes=2, long_len=min(long_len, 512), arrival_s=arrival_s,
            seed=99)  # warm-up: compile and allocate outside the timed trials
        trials = [run(engine, vocab, decodes=decodes, long_len=long_len, arrival_s=arrival_s,
                      seed=trial) for trial in range(args.trials)]
        for trial in trials:
            print(json.dumps({"long_prefill_token_threshold": threshold, **trial}), flush=True)
        results.append({"long_prefill_token_threshold": threshold,
                        "max_num_batched_tokens": engine.max_num_batched_tokens,
                        "trials": trials})
        del engine
        if gpu:
            torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "model": model or "SmolLM2-135M-Instruct (default)", "long_len": long_len,
            "decodes": decodes, "arrival_ms": arrival_s * 1000, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
