"""How long a prefill worker's handoff waits for a short prompt's blocks, under long prompts.

    python loadtest/handoff_send_wait.py --model loadtest/models/llama-3.1-8b --device cuda:0 \
        --out send_wait.json

The prefill worker's engine (dummy weights of `--model`'s config) with its handoff transport
(TcpTransfer holding the computed blocks in a SlotPool, as with `--kv-handoff ipc`) runs a
steady background of `--background` long prompts (`--background-len` tokens each, one token
each as on a prefill worker, a new one as each ends). Every `--gap-s` a short prompt
(`--short-len` tokens) joins; when its one token is out, two waits start at the same moment:
the handoff's (`flush_request`: the saves of the request's own blocks) and a wait for every
save queued so far (`flush`, what the handoff waited for before: it takes in the save of the
long prompt's step launched after the short one's last). Reported per wait: p50, p90 and max
in ms, over `--shorts` short prompts, after `--warmup` of them, and the background's prompt
tokens per second over the same time (the engine's prefill throughput). The gap between the short
request's first token and its second, on the decode worker, starts after this wait.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.tcp_blocks import BlockHolder
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer
from meshserve.shared.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def make_engine(args: argparse.Namespace) -> tuple[LLMEngine, TcpTransfer]:
    """The prefill worker's engine and transport (built as services/worker/__main__.py
    builds them for --role prefill --kv-handoff ipc)."""
    config = EngineConfig(model=args.model, load_format="dummy", dtype=args.dtype,
                          device=args.device, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=args.enforce_eager)
    pool = SlotPool(args.hold_bytes, torch.device(args.device))
    holder = BlockHolder(args.hold_bytes, 30.0, release=pool.release)
    made: list[TcpTransfer] = []

    def transport(kv_caches: KVCaches) -> TcpTransfer:
        made.append(TcpTransfer(kv_caches, holder=holder, pool=pool))
        return made[0]

    engine = build_engine(config, kv_tier=KVTierPlan(transport, 1 << 30))
    made[0].start()
    return engine, made[0]


class EngineLoop:
    """The engine stepped on a thread of its own (as the worker's engine thread): requests
    added through `add`, the short ones' ends reported on `ended`; a background prompt that
    ends is replaced by a new one."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.rng = random.Random(args.seed)
        self.vocab = engine.model_config.vocab_size
        self.adds: queue.Queue[tuple[str, list[int]]] = queue.Queue()
        self.ended: queue.Queue[str] = queue.Queue()
        self.stop = threading.Event()
        self.count = 0
        self.background_done = 0  # background prompts that ended
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab - 10) for _ in range(length)]

    def add(self, kind: str, length: int) -> str:
        self.count += 1
        request_id = f"{kind}{self.count}"
        self.adds.put((request_id, self.prompt(length)))
        return request_id

    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as error:  # reported to the waiting main thread
            self.error = error
            self.ended.put("")
            raise

    def _steps(self) -> None:
        while not self.stop.is_set():
            while not self.adds.empty():
                request_id, prompt = self.adds.get()
                self.engine.add_request(request_id, prompt, ONE_TOKEN)
            if not self.engine.has_unfinished_requests():
                time.sleep(0.001)
                continue
            for output in self.engine.step():
                if output.finish_reason is None:
                    continue
                if output.request_id.startswith("s"):
                    self.ended.put(output.request_id)
                else:
                    self.background_done += 1
                    self.add("b", self.args.background_len)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    engine, transfer = make_engine(args)
    loop = EngineLoop(engine, args)
    for _ in range(args.background):
        loop.add("b", args.background_len)
    loop.thread.start()
    own: list[float] = []
    whole: list[float] = []
    began_at, ended_before = 0.0, 0
    try:
        for i in range(args.warmup + args.shorts):
            if i == args.warmup:
                began_at, ended_before = time.perf_counter(), loop.background_done
            time.sleep(args.gap_s)  # the short prompts' pacing
            request_id = loop.add("s", args.short_len)
            ended = loop.ended.get(timeout=120)
            if loop.error is not None:
                raise RuntimeError("the engine thread failed") from loop.error
            assert ended == request_id
            began = time.perf_counter()
            done: list[float] = []
            waiter = threading.Thread(target=wait_all, args=(transfer, done))
            waiter.start()
            assert transfer.flush_request(request_id, 60.0), "the request's saves timed out"
            mine = time.perf_counter()
            waiter.join()
            if i >= args.warmup:
                own.append((mine - began) * 1e3)
                whole.append((done[0] - began) * 1e3)
        elapsed = time.perf_counter() - began_at
        background = (loop.background_done - ended_before) * args.background_len / elapsed
    finally:
        loop.stop.set()
        loop.thread.join(timeout=60)
        transfer.stop()
    return {"request_own_saves_ms": summary(own), "every_queued_save_ms": summary(whole),
            "background_prompt_tokens_per_s": background,
            "raw_own_ms": own, "raw_every_ms": whole}


def wait_all(transfer: TcpTransfer, done: list[float]) -> None:
    """Wait for every save queued so far (as the handoff did before), noting when."""
    transfer.flush(60.0)
    done.append(time.perf_counter())


def summary(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of `values`, and how many (loadtest/decode_listener_cost.py's
    too)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p90": at(0.9), "p99": at(0.99),
            "max": ordered[-1], "n": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (its config.json)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=8448)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hold-bytes", type=int, default=8 << 30)
    parser.add_argument("--background", type=int, default=4)
    parser.add_argument("--background-len", type=int, default=4096)
    parser.add_argument("--short-len", type=int, default=256)
    parser.add_argument("--shorts", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--gap-s", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"args": {k: str(v) for k, v in vars(args).items()}, **measure(args),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
              "torch": torch.__version__, "python": platform.python_version()}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({k: result[k] for k in ("request_own_saves_ms", "every_queued_save_ms",
                                             "background_prompt_tokens_per_s")}))


if __name__ == "__main__":
    main()
