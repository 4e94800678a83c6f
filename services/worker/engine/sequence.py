"""One sequence's state inside the engine, and what the engine reports for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshserve.services.worker.engine.images import PromptImage
from meshserve.shared.block_hash import BlockHash
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the state of a sequence imports no torch)
    from meshserve.services.worker.engine.mrope import MropePositions


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # asked several times per sequence per step: no lookups


_FINISHED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
             SequenceStatus.FINISHED_ABORTED)


# Stands in the output for a token sampled by a step still running on the device.
PENDING_TOKEN = -1
# `SequenceState.steps_since_drafts` of a sequence that never had drafts.
NEVER_DRAFTED = 1 << 30


class SequenceState:
    """One sequence: a prompt and the tokens generated for it so far.

    `num_computed_tokens` counts tokens whose KV is in the cache (prefix-cache
    hits included); the scheduler advances it. A request with n > 1 becomes n
    sequences sharing `group_id`, indexed by `index`.

    With the overlapped loop, a token sampled by a step still on the device is
    already counted: `PENDING_TOKEN` holds its place at the end of the output
    until the step's results are read (`num_pending` of them, at most two).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        group_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        arrival_time: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int,
        extra_keys: tuple[object, ...] = (),
        leader: SequenceState | None = None,
        lora_id: int | None = None,
        images: tuple[PromptImage, ...] = (),
        mrope: MropePositions | None = None,
    ) -> None:
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.eos_token_ids = eos_token_ids
        # Resolved output cap (params.max_tokens, or what the context leaves).
        self.max_tokens = max_tokens
        self.extra_keys = extra_keys
        self.lora_id = lora_id  # the LoRA adapter the sequence runs with (None: the base)
        # The prompt's images, in order: their embeddings replace their placeholder tokens.
        self.images = images
        # An M-RoPE model's positions of the prompt (engine/mrope.py; None: its indices).
        self.mrope = mrope
        # A sibling whose prompt blocks this one waits to share (n > 1).
        self.leader = leader
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing PENDING_TOKEN entries of output_token_ids
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set once
        self.num_preemptions = 0
        self.store_checked = False  # whether the KV tier was asked for its prompt blocks
        self.num_store_loaded_tokens = 0  # prompt tokens whose KV came from the KV tier
        self.block_hashes: list[BlockHash] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = []
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.stop_reason: int | str | None = None
        # Per-sequence random source when params.seed is set (a torch.Generator, set by the engine).
        self.generator: object | None = None
        # The grammar matcher (xgrammar) of a constrained sequence; it has accepted every
        # output token the host knows.
        self.grammar: object | None = None
        # params.bad_words as token sequences: the last token of each is banned where the
        # output ends with the others.
        self.bad_words: tuple[tuple[int, ...], ...] = ()
        # Draft tokens this step verifies after the last token (speculative decoding); they
        # are not output until accepted, so they count in no length above.
        self.spec_token_ids: list[int] = []
        # Engine steps since the sequence last had drafts (speculation's overlapped loop).
        self.steps_since_drafts = NEVER_DRAFTED

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (all but the pending ones at the end)."""
        return self.num_tokens - self.num_pending

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def drop_pending(self) -> None:
        """Forget tokens still on their way (the sequence has finished without them)."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending:]
            self.num_pending = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_prefilling(self) -> bool:
        """Whether the KV of the prompt (or, after preemption, of prompt + output) is incomplete."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"SequenceState({self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


@dataclass
class SequenceOutput:
    """What one engine step produced for one sequence: a delta, never the whole history."""

    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # A beam search's hypothesis: its score, cumulative_logprob / length ** length_penalty.
    beam_score: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
