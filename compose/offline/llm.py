"""In-process generation over an engine: what run-batch and the benchmarks use.

Not a service: like the launcher and the benchmarks, it composes the worker's engine and
the tokenizer's text side in one process, which no service may do.

`OfflineLLM.generate` adds every item to the engine, steps it until all are
done, and turns each sequence's token deltas into text through a `TextStream`
(incremental detokenization and stop strings). A stop string finishes its
sequence at once; the engine request is aborted when all of its n sequences
are done, since the engine aborts per request, not per sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshserve.services.tokenizer.detokenizer import TextStream
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.engine.sequence import SequenceOutput as EngineOutput
from meshserve.shared.errors import InternalError, InvalidRequestError, NotFoundError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams


class EngineLike(Protocol):
    """The engine calls the offline runner makes (`LLMEngine` provides them)."""

    model_config: Any

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None,
                    lora_id: int | None = None,
                    images: Sequence[PromptImage] = ()) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[EngineOutput]: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclass(frozen=True)
class GenerationItem:
    """One request to generate: prompt token ids and how to sample."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_id: int | None = None
    """The LoRA adapter to run it with (None: the base model)."""
    images: tuple[PromptImage, ...] = ()
    """The prompt's images over their placeholder tokens (vision-language models)."""


@dataclass
class CompletedSequence:
    """One of the n sequences of a request, once finished."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """Everything generated for one item, or the error that rejected it."""

    request_id: str
    prompt_token_ids: list[int]
    sequences: list[CompletedSequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: InvalidRequestError | NotFoundError | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


class _Tracker:
    """Per-item state while the engine works on it."""

    def __init__(self, position: int, item: GenerationItem, tokenizer: Tokenizer) -> None:
        self.position = position
        n = item.params.n
        want_logprobs = item.params.logprobs is not None
        self.result = GenerationResult(item.request_id, list(item.prompt_token_ids), [
            CompletedSequence(i, logprobs=[] if want_logprobs else None) for i in range(n)])
        self.streams = [TextStream(tokenizer, item.params, item.prompt_token_ids)
                        for _ in range(n)]
        self.parts: list[list[str]] = [[] for _ in range(n)]
        self.live = n
        self.needs_abort = False  # a sequence stopped on a stop string the engine never saw

    def apply(self, out: EngineOutput) -> bool:
        """Take one sequence delta; True when this made the whole item finished."""
        result = self.result
        if out.prompt_logprobs is not None and result.prompt_logprobs is None:
            result.prompt_logprobs = out.prompt_logprobs
        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
        if not 0 <= out.index < len(result.sequences):
            raise InternalError(f"engine output for {out.request_id!r} has sequence index "
                                f"{out.index}, expected 0..{len(result.sequences) - 1}")
        seq = result.sequences[out.index]
        if seq.finished:
            return False  # e.g. tokens generated after a stop string, before the abort
        seq.token_ids.extend(out.new_token_ids)
        if seq.logprobs is not None and out.new_logprobs:
            seq.logprobs.extend(out.new_logprobs)
        on_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        delta = self.streams[out.index].feed(out.new_token_ids, out.finished, on_token)
        self.parts[out.index].append(delta.text)
        if delta.stopped:
            self._finish(seq, "stop", delta.stop_reason)
            self.needs_abort = self.needs_abort or not out.finished
        elif out.finished:
            self._finish(seq, out.finish_reason, out.stop_reason)
        return self.live == 0

    def _finish(self, seq: CompletedSequence, reason: str | None, stop_reason: int | str | None
                ) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.text = "".join(self.parts[seq.index])
        self.live -= 1


class OfflineLLM:
    """An engine and its tokenizer, driven synchronously to completion."""

    def __init__(self, engine: EngineLike, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    def generate(self, items: Sequence[GenerationItem],
                 progress: Callable[[int], None] | None = None) -> list[GenerationResult]:
        """Generate every item; results come back in item order.

        `progress(position)` is called once per item when it finishes (or is
        rejected), with its position in `items`. An item the engine rejects
        (InvalidRequestError, ContextLengthError) gets `error` set; the others
        still run.
        """
        notify = progress or (lambda _position: None)
        results: list[GenerationResult] = []
        trackers: dict[str, _Tracker] = {}
        for position, item in enumerate(items):
            added = self._add(position, item, trackers)
            results.append(added.result)
            if added.result.error is not None:
                notify(position)
        live = {rid for rid, t in trackers.items() if t.result.error is None}
        while live:
            if not self.engine.has_unfinished_requests():
                raise InternalError(f"engine went idle with requests unfinished: {sorted(live)}")
            for out in self.engine.step():
                tracker = trackers.get(out.request_id)
                if tracker is None:
                    raise InternalError(f"engine returned output for unknown request "
                                        f"{out.request_id!r}")
                if out.request_id in live and tracker.apply(out):
                    live.discard(out.request_id)
                    if tracker.needs_abort:
                        self.engine.abort_request(out.request_id)
                    notify(tracker.position)
        self._drain(trackers)
        return results

    def _add(self, position: int, item: GenerationItem,
             trackers: dict[str, _Tracker]) -> _Tracker:
        tracker = _Tracker(position, item, self.tokenizer)
        if item.request_id in trackers:
            tracker.result.error = InvalidRequestError(
                f"duplicate request id {item.request_id!r}", param="request_id")
            tracker.result.sequences = []
            return tracker
        try:
            self.engine.add_request(item.request_id, list(item.prompt_token_ids), item.params,
                                    priority=item.priority, cache_salt=item.cache_salt,
                                    lora_id=item.lora_id, images=item.images)
        except (InvalidRequestError, NotFoundError) as exc:
            tracker.result.error = exc
            tracker.result.sequences = []
            return tracker
        trackers[item.request_id] = tracker
        return tracker

    def _drain(self, trackers: dict[str, _Tracker]) -> None:
        """Let the engine retire aborted requests so the next call starts clean."""
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id not in trackers:
                    raise InternalError(f"engine returned output for unknown request "
                                        f"{out.request_id!r}")
