"""How features plug into the engine core: one step-hook interface, given at construction.

The core (scheduler, KV cache manager, model runner, sampler, CUDA graphs) runs plain
decoding. Speculative decoding, LoRA adapters, structured outputs and the KV tier each
add a `StepHook` that the builder hands to the engine; the engine calls every hook at the
same fixed points of each request's life and of each step:

    add_request:  admit(sequences, request)         set per-sequence state, or refuse
    _finish:      release(sequence)                 the sequence is done (any reason)
    step:         step_begins()                     before anything else of the step
                  must_read_first(sampled) -> bool  read the step in flight before scheduling
                  before_schedule(running)          e.g. propose drafts
                  holds_back(sequence, n) -> bool   (the scheduler) keep a prompt waiting
                  record_verified(verified)         a verify pass's outcome, applied
                  step_ends(idle) -> bool           after the launch; True: device work queued

Three features also act inside the runner's forward pass, and the runner takes them as parts
at construction, typed by the protocols below (so that the core imports no feature):
`AdapterSlots` (LoRA: which adapter slot each row of the batch uses), `DraftVerifier`
(speculation: the verify pass over [last token + drafts] queries) and `ImageEmbedder`
(images: the vision encoder's rows for placeholder tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from meshserve.services.worker.engine.images import ImageSlice, PromptImage
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """What a request brought besides its tokens, for the hooks' `admit`."""

    request_id: str
    params: SamplingParams
    lora_id: int | None = None
    images: tuple[PromptImage, ...] = ()  # the prompt's images (engine/images.py)
    # The compiled grammar of `params.structured` and `params.bad_words` tokenized, when the
    # caller prepared them ahead (the worker's engine thread does); else the hook does.
    grammar: Any = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass
class Verified:
    """One speculating sequence's outcome: the tokens it emits (accepted drafts, then the
    correction or bonus token), their logprobs where asked, and how many drafts it had."""

    request: SequenceState
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


class StepHook:
    """A feature's part in the engine loop. Every method does nothing here; a feature
    overrides those it needs. Hooks run on the engine's thread, in the order given."""

    def admit(self, sequences: Sequence[SequenceState], request: NewRequest) -> None:
        """A request's sequences before they are queued: set their state for this feature,
        or raise a MeshError to refuse the request (nothing of it is queued then)."""

    def release(self, sequence: SequenceState) -> None:
        """`sequence` finished (stopped, aborted or refused after admission)."""

    def step_begins(self) -> None:
        """A step starts (before the step in flight is read)."""

    def must_read_first(self, sampled: Sequence[SequenceState]) -> bool:
        """Whether the step in flight (which samples `sampled`) must be read before the next
        step is scheduled, instead of overlapping it."""
        return False

    def before_schedule(self, running: Sequence[SequenceState]) -> None:
        """The running sequences, just before the scheduler picks the step."""

    def holds_back(self, sequence: SequenceState, num_local_blocks: int) -> bool:
        """Whether a waiting prompt, `num_local_blocks` of whose blocks the prefix cache
        holds, should wait this step (e.g. for blocks loading from elsewhere)."""
        return False

    def record_verified(self, verified: Verified) -> None:
        """A verify pass's outcome, once the engine applied it."""

    def step_ends(self, idle: bool) -> bool:
        """The step is launched (`idle`: nothing ran or was read). True when the hook
        queued work on the device after the step's own."""
        return False


class AdapterStack(Protocol):
    """The adapters' device slots hooked into the model (services/worker/lora/stack.py)."""

    # Whether the model's LoRA hooks run: set per step from its rows' adapters, and by the
    # CUDA graph runners around captures with and without them.
    active: bool


class AdapterSlots(Protocol):
    """The runner's view of multi-LoRA serving (services/worker/lora/manager.py)."""

    @property
    def stack(self) -> AdapterStack:
        """The slots (CUDA graphs capture them)."""

    def prepare_step(self, rows: list[tuple[int | None, int]]) -> list[tuple[int, int]]:
        """(adapter id or None, row count) per sequence -> (slot or -1, rows) groups; makes
        the step's adapters resident and sets the step's grouping."""

    def take_writes(self) -> list[tuple[int, Any]]:
        """The slot writes made since the last call (for the other tensor-parallel ranks)."""

    def write_slot(self, slot: int, weights: Any) -> None:
        """Put an adapter's weights into a slot (a follower rank, as rank 0 did)."""

    def set_step(self, groups: list[tuple[int, int]]) -> None:
        """Use rank 0's grouping for this step (a follower rank)."""


class PendingVerification(Protocol):
    def read(self) -> list[Verified]:
        """Wait for the verify pass and return each sequence's outcome."""


class DraftVerifier(Protocol):
    """The runner's view of speculative decoding's verify pass (services/worker/spec/)."""

    def launch(self, logits: torch.Tensor, requests: list[SequenceState]
               ) -> PendingVerification:
        """Queue the verification of `requests`' drafts from their rows' logits
        ([sum(k_i + 1), V] float32)."""


class ImageEmbedder(Protocol):
    """The vision encoder as the model runner uses it (services/worker/vision/)."""

    def embed(self, slices: Sequence[ImageSlice]) -> torch.Tensor:
        """The embedding rows of `slices`, one after another: [sum of counts, H], in the
        model's dtype on its device."""
        ...

    def prefetch(self, images: Sequence[PromptImage]) -> Future[bool] | None:
        """Start making `images`' rows off the engine thread (encoder services), or None
        when there is nothing to start; the request waits for the future."""
        ...

    def check(self, images: Sequence[PromptImage]) -> None:
        """Refuse (InvalidRequestError) an image that does not decode, or whose embedding
        rows differ in number from its placeholder tokens."""
        ...

