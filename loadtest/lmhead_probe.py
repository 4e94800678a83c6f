"""Host time of the LM head's product in the steps of a ShareGPT-like burst (diagnostic).

Driver part: none (a GPU diagnostic cited by docs/operations.md).

    python3 loadtest/lmhead_probe.py MODEL_DIR [ENGINE_JSON] [MODE]     # on one GPU

Builds an engine (dummy weights; ENGINE_JSON adds EngineConfig fields, e.g.
'{"quantization": "fp8", "kv_cache_dtype": "fp8"}'), queues 800 ShareGPT-like requests at
once and runs 120 steps, timing on the host each call of the LM head's product (the model's
`linear` with an output wider than 100,000 columns). Per call it prints the rows (after any
padding `CausalLM.compute_logits` adds), the host time of a step taken just before (MODE),
the product's host time, and whether the caching allocator asked the driver for memory.
MODE: "none" (the product alone), "sync" (wait for the device first: the product's own host
cost on an idle device), "empty" (one tiny kernel first: does any launch block there?).
This is how the stall behind loadtest/reports/fp8/README.md's "host stalls in the LM head"
was found: with unpadded row counts the product held the host 75-220 ms in prefill steps.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from meshserve.bench.engine import random_prompts, sharegpt_like_lengths
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.models import llama
from meshserve.shared.sampling_params import SamplingParams


def main(argv: list[str]) -> int:
    model = argv[0]
    overrides = json.loads(argv[1]) if len(argv) > 1 else {}
    mode = argv[2] if len(argv) > 2 else "none"
    engine = build_engine(EngineConfig(model=model, load_format="dummy", max_model_len=2048,
                                       **overrides))
    lengths = sharegpt_like_lengths(800, 0, engine.max_model_len)
    prompts = random_prompts([i for i, _ in lengths], engine.model_config, 0)
    for i, (p, (_, out)) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=out, ignore_eos=True))
    calls: list[tuple[int, float, float, int]] = []
    product = llama.linear

    def timed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.shape[0] < 100_000:
            return product(x, w, b)
        allocs = torch.cuda.memory_stats()["num_device_alloc"]
        t0 = time.perf_counter()
        if mode == "sync":
            torch.cuda.current_stream().synchronize()
        elif mode == "empty":
            torch.empty(1, device=x.device).add_(1)
        t1 = time.perf_counter()
        out = product(x, w, b)
        t2 = time.perf_counter()
        calls.append((x.shape[0], (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                      torch.cuda.memory_stats()["num_device_alloc"] - allocs))
        return out

    llama.linear = timed  # type: ignore[assignment]
    started = time.perf_counter()
    for _ in range(120):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    print(f"120 steps in {time.perf_counter() - started:.2f} s")
    for rows, before, took, segments in calls:
        print(f"rows {rows:5d}  {mode} {before:8.2f} ms  product {took:8.2f} ms  "
              f"new segments {segments}")
    print(f"calls {len(calls)}, product host time {sum(c[2] for c in calls):.0f} ms, "
          f"over 5 ms: {sum(c[2] > 5 for c in calls)}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
