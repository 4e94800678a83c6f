"""The gateway process settles its heap once listening (services/gateway/__main__.py)."""

from __future__ import annotations

import gc

from meshserve.services.gateway.__main__ import GC_THRESHOLDS, settle_heap


def test_settle_heap_freezes_what_the_start_built_and_spaces_young_collections() -> None:
    thresholds = gc.get_threshold()
    gc.collect()
    built = [[i] for i in range(1000)]  # lives past the start, as the app and channels do
    try:
        settle_heap()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() >= len(built)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
