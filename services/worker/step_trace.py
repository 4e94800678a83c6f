"""Diagnostics: a record of every engine step (`--step-trace`), for the worker and the
in-process benchmark alike, so that a run through the mesh and one in process compare
step by step."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass


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
