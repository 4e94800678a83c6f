"""The engine thread trims malloc's free memory once it has been idle (IdleTrim), on a real
tiny engine: once after a request finished and the idle wait passed, not again while
nothing runs, and again after the next request."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.serving.idle_trim import IdleTrim
from meshserve.shared.sampling_params import SamplingParams

WAIT_S = 30.0


async def run_one(thread: EngineThread, request_id: str) -> None:
    stream = thread.submit(request_id, [[5, 17, 99, 3]],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while await stream.next() is not None:
        pass


async def test_an_idle_engine_trims_once_per_burst(tiny_llama_dir: Path) -> None:
    engine = build_engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                       device="cpu", num_kv_blocks=16, block_size=16))
    trimmed = threading.Semaphore(0)
    calls: list[bool] = []

    def trim() -> int:
        calls.append(engine.has_unfinished_requests())
        trimmed.release()
        return 1

    thread = EngineThread(engine)
    thread.idle_trim = IdleTrim(0.05, idle_s=0.05, trim=trim)
    thread.start()
    try:
        await run_one(thread, "a")
        assert await asyncio.to_thread(trimmed.acquire, timeout=WAIT_S)
        assert thread.idle_trim.wait_s() is None  # nothing ran since: it waits for work
        await run_one(thread, "b")
        assert await asyncio.to_thread(trimmed.acquire, timeout=WAIT_S)
        assert calls == [False, False]  # each time with nothing left to run
        assert thread.idle_trim.trims == 2
    finally:
        thread.stop()
        await thread.wait_stopped()
