"""One request's output on the event loop: per-sequence deltas merged until the reader takes them.

The engine thread's per-step batches are pushed in (`push`, then `end_step` once
per step); the reader awaits `next()`, which returns everything produced since its
previous call: for each sequence that progressed, all its new tokens in order. A
slow reader therefore gets one larger update rather than a backlog of small ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from meshserve.services.worker.engine.sequence import SequenceOutput, SequenceState
from meshserve.shared.errors import MeshError
from meshserve.shared.logprobs import TokenLogprobs

ABORT = "abort"


@dataclass(frozen=True)
class StepTiming:
    """How long the engine step that produced some output took."""

    forward_ns: int


@dataclass(frozen=True)
class SequenceTimes:
    """Scheduling timestamps of one engine request (time.monotonic() seconds)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    num_preemptions: int

    @classmethod
    def of(cls, sequences: Sequence[SequenceState]) -> SequenceTimes:
        """The earliest timestamps over a request's n sequences, and their preemptions."""
        scheduled = [s.first_scheduled_time for s in sequences if s.first_scheduled_time]
        tokens = [s.first_token_time for s in sequences if s.first_token_time]
        return cls(arrival=min(s.arrival_time for s in sequences),
                   first_scheduled=min(scheduled, default=None),
                   first_token=min(tokens, default=None),
                   num_preemptions=sum(s.num_preemptions for s in sequences))


@dataclass
class RequestTimes:
    """Where a request's time went so far (monotonic seconds; None: not yet)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_steps: int = 0
    num_preemptions: int = 0
    step_forward_ns: int = 0

    def durations_ns(self, now: float) -> tuple[int, int, int]:
        """(queued, prefill, decode) in ns as of `now`, each 0 until its phase starts."""
        end = self.finished if self.finished is not None else now
        scheduled = self.first_scheduled
        token = self.first_token
        queued = (scheduled if scheduled is not None else end) - self.arrival
        prefill = 0.0 if scheduled is None else (token if token is not None else end) - scheduled
        decode = 0.0 if token is None else end - token
        return tuple(max(int(d * 1e9), 0) for d in (queued, prefill, decode))  # type: ignore


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence produced since the reader last took its output.

    `first`: this is the sequence's first delta (it carries the prompt logprobs and the
    cached-token count the reader has not seen yet).
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    first: bool = False

    def merge(self, out: SequenceOutput) -> None:
        """Append one engine delta of this sequence."""
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs = (self.logprobs or []) + list(out.new_logprobs)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens


@dataclass(frozen=True)
class StreamUpdate:
    """One message's worth of output: the deltas of sequences that progressed, by index."""

    deltas: list[SequenceDelta]
    times: RequestTimes


class RequestStream:
    """Output of one request (all its sequences), merged until the reader takes it.

    Only the event loop touches a stream. Sequence p * n + s is sample s of prompt p.
    A reader either awaits `next()` (one stream per call), or passes `on_ready`, called
    whenever the stream has something new (output, an end, an error), and takes it with
    `take()` (a session multiplexing many streams).
    """

    def __init__(self, request_id: str, prompt_lengths: Sequence[int], n: int,
                 arrival: float, on_ready: Callable[[RequestStream], None] | None = None,
                 resumed: Mapping[int, int] | None = None) -> None:
        """`resumed` (sequence index -> output tokens it had): a request moved here from
        another worker, of which only those sequences run."""
        self.request_id = request_id
        self.num_sequences = len(prompt_lengths) * n
        self.times = RequestTimes(arrival=arrival)
        self._prompt_lengths = prompt_lengths
        self._n = n
        # (prompt, cached, output) tokens of each sequence as last reported.
        self._counts: dict[int, tuple[int, int, int]] = {
            i: (prompt_lengths[i // n], 0, count) for i, count in (resumed or {}).items()}
        self._live = set(range(self.num_sequences)) if resumed is None else set(resumed)
        self._seen: set[int] = set()  # sequences whose first delta was taken
        self._pending: dict[int, SequenceDelta] = {}
        self._preemptions: dict[int, int] = {}
        self.error: MeshError | None = None
        self._on_ready = on_ready
        self._ready = asyncio.Event() if on_ready is None else None

    @property
    def finished(self) -> bool:
        """Whether every sequence has finished (its last delta may still be unread)."""
        return not self._live

    @property
    def drained(self) -> bool:
        """Whether every sequence has finished and every delta was taken (or it failed)."""
        return not self._live and not self._pending

    def all_finished(self, indices: Iterable[int]) -> bool:
        return all(i not in self._live for i in indices)

    def push(self, out: SequenceOutput, offset: int, times: SequenceTimes | None) -> None:
        """Take an engine delta of sample `out.index` of the prompt at `offset`."""
        index = offset + out.index
        if index not in self._live:
            return  # aborted here already; the engine catches up a step later
        delta = self._pending.get(index)
        if delta is None:
            delta = self._pending[index] = SequenceDelta(index, first=index not in self._seen)
            self._seen.add(index)
        delta.merge(out)
        self._counts[index] = (out.num_prompt_tokens, out.num_cached_tokens,
                               out.num_output_tokens)
        if out.finish_reason is not None:
            self._live.discard(index)
        if times is not None:
            self._note_times(offset, times)

    def _note_times(self, offset: int, times: SequenceTimes) -> None:
        t = self.times
        t.first_scheduled = _earliest(t.first_scheduled, times.first_scheduled)
        t.first_token = _earliest(t.first_token, times.first_token)
        self._preemptions[offset] = times.num_preemptions
        t.num_preemptions = sum(self._preemptions.values())

    def end_step(self, timing: StepTiming | None) -> None:
        """One engine step produced output for this stream: count it, wake the reader."""
        self.times.num_steps += 1
        if timing is not None:
            self.times.step_forward_ns = timing.forward_ns
        self._wake()

    def abort(self, indices: Sequence[int] = ()) -> int:
        """Finish live sequences (all when `indices` is empty) as aborted; returns how many."""
        chosen = [i for i in (indices or sorted(self._live)) if i in self._live]
        for index in chosen:
            delta = self._pending.get(index)
            if delta is None:
                prompt, cached, output = self._counts.get(
                    index, (self._prompt_lengths[index // self._n], 0, 0))
                delta = self._pending[index] = SequenceDelta(
                    index, num_prompt_tokens=prompt, num_cached_tokens=cached,
                    num_output_tokens=output, first=index not in self._seen)
                self._seen.add(index)
            delta.finish_reason, delta.stop_reason = ABORT, None
            self._live.discard(index)
        if chosen:
            self._wake()
        return len(chosen)

    def fail(self, error: MeshError) -> None:
        """End the stream with `error` (raised by `next()`, held in `error` for `take()`)."""
        self.error = error
        self._live.clear()
        self._pending.clear()
        self._wake()

    def take(self) -> list[SequenceDelta]:
        """Every delta since the previous take, by sequence index (empty when none)."""
        if not self._pending:
            return []
        deltas = [self._pending[i] for i in sorted(self._pending)]
        self._pending = {}
        return deltas

    async def next(self) -> StreamUpdate | None:
        """Everything produced since the previous call; None once all sequences finished."""
        assert self._ready is not None, "a stream with on_ready is read with take()"
        while True:
            if self.error is not None:
                raise self.error
            if self._pending:
                break
            if not self._live:
                return None
            self._ready.clear()
            await self._ready.wait()
        return StreamUpdate(self.take(), dataclasses.replace(self.times))

    def _wake(self) -> None:
        if not self._live and self.times.finished is None:
            self.times.finished = time.monotonic()
        if self._on_ready is not None:
            self._on_ready(self)
        else:
            assert self._ready is not None
            self._ready.set()


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
