"""settle_heap / settled_heap: a serving process's engine is frozen out of the collector's
full passes, and a long collection pause is logged."""

from __future__ import annotations

import gc
import logging
import threading
from pathlib import Path

import pytest

from meshserve.services.worker import heap as engine_module
from meshserve.services.worker.heap import settled_heap


def test_the_heap_is_frozen_for_the_run_and_released_after() -> None:
    assert gc.get_freeze_count() == 0
    built = [object() for _ in range(1000)]  # what an engine would have built
    with settled_heap():
        assert gc.get_freeze_count() >= len(built)
        assert gc.callbacks.count(engine_module._collector_watch) == 1  # pauses watched
        with settled_heap():  # settled twice: still watched once
            assert gc.callbacks.count(engine_module._collector_watch) == 1
    assert gc.get_freeze_count() == 0
    assert engine_module._collector_watch not in gc.callbacks  # the run's watch is over


def test_a_long_collection_is_logged_and_a_short_or_asked_for_one_is_not(
        caplog: pytest.LogCaptureFixture) -> None:
    watch = engine_module._CollectorWatch()
    info = {"generation": 2, "collected": 7}
    with caplog.at_level(logging.WARNING, logger=engine_module.log.name):
        watch("start", info)
        watch("stop", info)  # immediately: far below the threshold
        watch("start", info)
        watch.began -= 2 * engine_module.GC_PAUSE_LOG_S
        watch("stop", info)
        watch.explicit = True
        watch("start", info)
        watch.began -= 2 * engine_module.GC_PAUSE_LOG_S
        watch("stop", info)
    pauses = [r.getMessage() for r in caplog.records if "garbage collection" in r.getMessage()]
    assert len(pauses) == 1 and "generation 2" in pauses[0] and "7 objects" in pauses[0]


def test_waiting_for_the_grammar_preload_ends_when_it_ends_or_at_the_timeout() -> None:
    from meshserve.services.worker.structured.grammars import GrammarCompiler

    gate = threading.Event()

    def tokenizer_folder() -> Path:  # a preload that is still running until the gate opens
        gate.wait(30)
        raise FileNotFoundError("no tokenizer here")

    grammars = GrammarCompiler(tokenizer_folder, vocab_size=64, eos_token_ids=[0])
    assert grammars.wait_preloaded(0.0)  # nothing preloading: nothing to wait for
    grammars.preload()
    assert not grammars.wait_preloaded(0.05)  # still running: the caller goes on
    gate.set()
    assert grammars.wait_preloaded(30)  # ended (failed, which is logged): done
