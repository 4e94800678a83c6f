"""Settling a serving process's heap once its engine is built (gc.freeze), and logging the
collector's long pauses.

Not part of the engine core: it waits for the structured-outputs feature's grammar
preload, which the core does not know about.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.structured.hook import StructuredOutputsHook

log = logging.getLogger(__name__)

# A collection at least this long is logged (a step of a large model takes a few ms).
GC_PAUSE_LOG_S = 0.02
# The longest `settle_heap` waits for the engine's grammar preload (a 128k vocabulary takes
# seconds; a stuck one must not hold a starting server).
PRELOAD_WAIT_S = 60.0


def settle_heap(engine: LLMEngine | None = None) -> None:
    """Call once a serving process has built its engine and is ready to serve. What it
    built lives as long as the process (modules, graphs, caches, servers, clients, and what
    `engine`'s grammar preload loads, waited for here): frozen, it is left out of the
    collector's full passes, which would otherwise walk all of it between two steps, a
    pause of tens of ms that also stalls every other rank of a tensor-parallel group. Long
    pauses are logged. It blocks (the preload, one full collection): not on an event loop."""
    structured = engine.hook(StructuredOutputsHook) if engine is not None else None
    if structured is not None and not structured.grammars.wait_preloaded(PRELOAD_WAIT_S):
        log.warning("the grammar preload is still running after %.0f s; settling the heap "
                    "without it", PRELOAD_WAIT_S)
    if _collector_watch not in gc.callbacks:
        gc.callbacks.append(_collector_watch)
    _collector_watch.explicit = True  # this collection's pause is asked for: not logged
    try:
        gc.collect()
    finally:
        _collector_watch.explicit = False
    gc.freeze()


@contextlib.contextmanager
def settled_heap(engine: LLMEngine | None = None) -> Iterator[None]:
    """`settle_heap` for a run that ends before the process does (run-batch, bench): the
    heap is unfrozen after it, so what the engine built can be collected, and pauses are no
    longer logged (the collections of whatever the process does next are not the run's)."""
    settle_heap(engine)
    try:
        yield
    finally:
        gc.unfreeze()
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(_collector_watch)


class _CollectorWatch:
    """Logs every garbage collection of this process that takes GC_PAUSE_LOG_S or longer."""

    def __init__(self) -> None:
        self.began = 0.0
        self.explicit = False

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif (paused := time.perf_counter() - self.began) >= GC_PAUSE_LOG_S \
                and not self.explicit:
            log.warning("garbage collection of generation %d took %.1f ms (%d objects freed)",
                        info["generation"], paused * 1e3, info["collected"])


_collector_watch = _CollectorWatch()
