"""A worker settles its heap once it is ready to serve: what it builds around the engine,
the grammar preload's tokenizer included (loaded on a pool thread after the engine is
built), is frozen out of the collector's full passes before the first request."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

from engine_features import grammars_of
from tiny_models import build_tiny_model

from meshserve.services.worker import heap as engine_module
from meshserve.services.worker.__main__ import WorkerProcess, load_engine
from meshserve.services.worker.config import WorkerConfig
from meshserve.shared.service_main import service_telemetry


async def test_the_grammar_preload_is_frozen_before_the_worker_serves(
        tmp_path: Path, redis_url: str) -> None:
    folder = build_tiny_model(tmp_path / "model")
    config = WorkerConfig.from_mapping({
        "model": str(folder), "device": "cpu", "dtype": "float32", "port": 0,
        "host": "127.0.0.1", "num_kv_blocks": 64, "max_model_len": 256,
        "redis_url": redis_url})
    assert gc.get_freeze_count() == 0
    try:
        async with service_telemetry("worker", config) as telemetry:
            worker = WorkerProcess(config, load_engine(config), telemetry)
            try:
                await worker.start()
                tokenizer = grammars_of(worker.engine)._tokenizer
                assert tokenizer is not None, "the grammar preload has not loaded the tokenizer"
                assert gc.is_tracked(tokenizer)
                assert not any(o is tokenizer for o in gc.get_objects()), \
                    "the preload's tokenizer is not frozen"
            finally:
                await worker.server.drain(0)
                await worker.close()
    finally:  # the test process goes on: what a worker process keeps is undone
        gc.unfreeze()
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(engine_module._collector_watch)
