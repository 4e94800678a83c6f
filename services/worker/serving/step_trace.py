"""Diagnostics: a record of every engine step (`--step-trace`), for the worker and the
in-process benchmark alike, so that a run through the mesh and one in process compare
step by step."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for diagnostics: when it ended (time.perf_counter()), how long
    step() took, the sequences running and waiting after it, the requests added just before
    it, and the outputs and tokens it produced."""

    end_s: float
    duration_s: float
    running: int
    waiting: int
    added: int
    outputs: int
    tokens: int
    pending_prefill_tokens: int = 0
    """Prompt tokens still to prefill across running and waiting sequences after it."""
    device_busy_s: float = 0.0
    """Device time in the steps it finished since the last record (DeviceTimeline, on a
    GPU): their work, without the KV tier's gathers (`tier_s`) and the gaps (`idle_s`)."""
    device_idle_s: float = 0.0
    """Time the device had no step work queued, before the steps it finished since."""
    tier_s: float = 0.0
    """Device time of the KV tier's gathers after those steps."""


class DeviceFields(TypedDict, total=False):
    """StepRecord's device-time fields, as keyword arguments (`**device_fields(engine)`)."""

    device_busy_s: float
    device_idle_s: float
    tier_s: float


def device_fields(engine: Any) -> DeviceFields:
    """The StepRecord fields of the engine's device time since the last call (none when
    the engine does not time its device)."""
    if engine.timeline is None:
        return {}
    times = engine.timeline.take()
    return {"device_busy_s": times.busy_s, "device_idle_s": times.idle_s,
            "tier_s": times.tier_s}


def write_step_trace(path: str, records: Sequence[StepRecord]) -> None:
    """The records as JSON lines, times relative to the first record's start."""
    if not records:
        return
    origin = records[0].end_s - records[0].duration_s
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            row = dataclasses.asdict(record)
            row["end_s"] = round(record.end_s - origin, 6)
            out.write(json.dumps(row) + "\n")
