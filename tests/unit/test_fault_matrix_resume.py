"""How the fault drill measures when a killed worker's streams resumed."""

from __future__ import annotations

import math

from loadtest_scripts import load_script

fault_matrix = load_script("fault_matrix")


def _end(*times: float):
    return fault_matrix.StreamEnd(chunks=len(times), chunk_times=list(times), done=True)


def test_the_moved_streams_are_the_unfinished_ones_that_waited_longest() -> None:
    ends = [_end(1.0, 2.1, 2.2), _end(1.0, 3.5), _end(1.0, 2.4), _end(0.5, 1.5)]
    # Killed at 2.0: the last stream had finished at 1.5 and is no candidate.
    assert fault_matrix._resume_times(ends, 2.0, 2) == [0.4, 1.5]
    # More moved streams than were still streaming: only those that were.
    assert fault_matrix._resume_times(ends, 2.0, 5) == [0.1, 0.4, 1.5]
    assert fault_matrix._resume_times(ends, 2.0, 0) == []


def test_a_stream_that_never_streams_again_counts_as_never_resumed() -> None:
    ends = [_end(1.0), _end(1.0, 2.5)]
    ends[0].chunk_times = []  # no chunk at all: still waiting at the kill, then nothing
    assert fault_matrix._resume_times(ends, 2.0, 2) == [0.5, math.inf]
