"""What a prompt's first step costs on a GPU: fused-attention backends on new and repeated
prompt lengths, and the kernels a fresh process compiles on its first batches.

Driver part: none (a GPU probe cited by kernels/attention.py and the worker).

    python loadtest/first_prefill_probe.py --model PATH [--load-format dummy] --out probe.json

One engine in this process (the worker's `build_engine`, 0.45 of the GPU). After the
worker's own warm-up (`warm_up`, unless --no-warm-up): the first step of a single prompt of
each length in --lengths, three times at one length (distinct tokens) and once at one more,
under each fused-attention backend order (cuDNN first, FlashAttention first) and with the
paged kernel only; then the first step of a batch of six prompts and of a prompt past a
cached prefix, which compile Triton kernels when the worker's warm-up did not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshserve.kernels import attention
from meshserve.services.worker.__main__ import build_engine, warm_up
from meshserve.services.worker.config import WorkerConfig
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.shared.sampling_params import SamplingParams

ORDERS = {"cudnn-first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
          "flash-first": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]}


def backends(order: list[SDPBackend]):  # type: ignore[no-untyped-def]
    @contextlib.contextmanager
    def chosen(on_gpu: bool) -> Iterator[None]:
        with sdpa_kernel(order, set_priority=True):
            yield
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--lengths", default="10,300,2048,8000")
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    config = WorkerConfig.from_args([
        "--model", args.model, "--load-format", args.load_format, "--device", "cuda",
        "--gpu-memory-utilization", "0.45", "--max-model-len", str(max(lengths) + 64),
        "--max-num-batched-tokens", str(max(8192, max(lengths) + 64))])
    engine = build_engine(config)
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(0),
                                 "torch": torch.__version__, "command": sys.argv}
    if not args.no_warm_up:
        async def warm() -> float:
            thread = EngineThread(engine)
            thread.start()
            began = time.perf_counter()
            await warm_up(thread)
            took = time.perf_counter() - began
            thread.stop()
            await thread.wait_stopped()
            return took

        report["warm_up_s"] = round(asyncio.run(warm()), 3)
    serial = [0]

    def tokens(n: int) -> list[int]:  # never a prefix of an earlier prompt
        serial[0] += 1
        return [(serial[0] * 7919 + j) % 120000 + 10 for j in range(n)]

    def first_step_ms(prompts: list[list[int]]) -> float:
        for p in prompts:
            serial[0] += 1
            engine.add_request(f"probe-{serial[0]}", p,
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        began = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        took = (time.perf_counter() - began) * 1e3
        while engine.has_unfinished_requests():
            engine.step()
        return round(took, 1)

    report["first_batch_of_six_ms"] = first_step_ms([tokens(n) for n in (12, 20, 33, 48, 70,
                                                                          129)])
    shared = tokens(64)
    first_step_ms([shared + tokens(5)])
    report["past_a_cached_prefix_ms"] = first_step_ms([shared + tokens(13)])
    runs: dict[str, dict[str, list[float]]] = {}
    for name, order in [*ORDERS.items(), ("paged", None)]:
        if order is None:
            attention._MAX_FRESH_PREFILL_SEQS = 0  # every prompt through the paged kernel
        else:
            attention._fused_backends = backends(order)
        runs[name] = {str(n): [first_step_ms([tokens(n)]) for _ in range(3)]
                      + [first_step_ms([tokens(n + 1)])] for n in lengths}
        for n, times in runs[name].items():
            print(f"{name:<12} {n:>5} tokens: x3 then +1: {times}", flush=True)
    report["single_prompt_first_step_ms"] = runs
    print(json.dumps({k: v for k, v in report.items() if k != "single_prompt_first_step_ms"}))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
