"""Speculation across the engine's steps: which sequences draft, how far, and the counts
of drafted and accepted tokens (vLLM's spec_decode metrics read them)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from meshserve.services.worker.engine.hooks import StepHook, Verified
from meshserve.services.worker.engine.sequence import NEVER_DRAFTED, SequenceState, SequenceStatus
from meshserve.services.worker.spec.ngram import NgramProposer, TokenHistory
from meshserve.shared.speculative_config import SpeculativeConfig

# A sequence that had drafts this many steps ago or fewer is waited for (`waits_for`).
RECENT_DRAFT_STEPS = 2


class Proposer(Protocol):
    def propose_batch(self, requests: list[SequenceState], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow requests[i]'s tokens, for each request."""
        ...

    def may_draft(self, request: SequenceState) -> bool:
        """Whether `request`, whose last tokens are still on the device, is likely to get
        drafts once they are read (judged from the tokens on the host)."""
        ...


@dataclass
class SpecStats:
    """Cumulative counts, read by the metrics collector from another thread (ints only,
    updated under the lock)."""

    num_drafts: int = 0  # sequences that verified at least one draft, summed over steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[j]: drafts accepted at position j (0-based) of their sequence's run
    accepted_per_pos: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        with self.lock:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            if len(self.accepted_per_pos) < num_drafts:
                self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
            for j in range(num_accepted):
                self.accepted_per_pos[j] += 1

    def snapshot(self) -> tuple[int, int, int, list[int]]:
        with self.lock:
            return (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                    list(self.accepted_per_pos))


class SpecDecoder(StepHook):
    """Sets each eligible decoding sequence's drafts before the step is scheduled (the
    engine's step hook of speculative decoding)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    def num_drafts_for(self, request: SequenceState) -> int:
        """How many drafts the sequence may verify this step (0: it does not speculate).

        Constrained sequences (structured outputs) never speculate: their grammar would
        have to take each draft before its row's mask exists. Neither does a sequence
        still prefilling or with a token on the device. The count stops where the
        accepted run plus its bonus token would pass max_tokens or the context length.
        """
        if (request.status != SequenceStatus.RUNNING or request.grammar is not None
                or request.num_pending or request.is_prefilling
                or request.num_computed_tokens != request.num_tokens - 1):
            return 0
        room_out = request.max_tokens - request.num_output_tokens - 1
        room_ctx = self.max_model_len - request.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, room_out, room_ctx))

    def waits_for(self, requests: Sequence[SequenceState]) -> bool:
        """Whether the engine should read the step in flight (which sampled `requests`)
        before scheduling the next one: some of them could speculate then.

        Drafts follow a sequence's last token, so a sequence whose token is still on the
        device cannot draft. A sequence is waited for when it had drafts in the last
        RECENT_DRAFT_STEPS steps (a rejected draft leaves a token the text did not hold, and
        the token after it usually matches again) or its proposer expects drafts from the
        tokens on the host. Otherwise the next step is queued behind the one in flight (the
        overlapped loop) and these sequences decode one token in it."""
        return any(self._may_speculate(r) and (r.steps_since_drafts <= RECENT_DRAFT_STEPS
                                               or self.proposer.may_draft(r))
                   for r in requests)

    def _may_speculate(self, request: SequenceState) -> bool:
        """`num_drafts_for`'s conditions that do not depend on the pending tokens."""
        return (request.status == SequenceStatus.RUNNING and request.grammar is None
                and request.max_tokens - request.num_output_tokens > 1
                and self.max_model_len - request.num_tokens > 1)

    def propose(self, running: Sequence[SequenceState]) -> None:
        """Draft for every running sequence that may (clearing stale drafts of others)."""
        chosen: list[SequenceState] = []
        ks: list[int] = []
        for request in running:
            request.spec_token_ids = []
            request.steps_since_drafts = min(request.steps_since_drafts + 1, NEVER_DRAFTED)
            k = self.num_drafts_for(request)
            if k:
                chosen.append(request)
                ks.append(k)
        if not chosen:
            return
        for request, k, drafts in zip(chosen, ks, self.proposer.propose_batch(chosen, ks),
                                      strict=True):
            request.spec_token_ids = list(drafts[:k])
            if request.spec_token_ids:
                request.steps_since_drafts = 0

    def record(self, verified: Verified) -> None:
        if verified.num_drafts:
            self.stats.record(verified.num_drafts, verified.num_accepted)

    # ----- the step hook ----------------------------------------------------------
    def must_read_first(self, sampled: Sequence[SequenceState]) -> bool:
        return self.waits_for(sampled)

    def before_schedule(self, running: Sequence[SequenceState]) -> None:
        self.propose(running)

    def record_verified(self, verified: Verified) -> None:
        self.record(verified)


class NgramBatchProposer:
    """The n-gram proposer over each sequence's whole token history."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                    config.prompt_lookup_max)
        # Each sequence's known tokens, appended to step by step (by id, with the request
        # they belong to: a finished request's history is dropped at the next batch).
        self._histories: dict[str, tuple[SequenceState, TokenHistory]] = {}

    def propose_batch(self, requests: list[SequenceState], ks: list[int]) -> list[list[int]]:
        self._histories = {rid: entry for rid, entry in self._histories.items()
                           if not entry[0].is_finished}
        return [self._ngram.propose(self._tokens(r, r.num_tokens), k)
                for r, k in zip(requests, ks, strict=True)]

    def may_draft(self, request: SequenceState) -> bool:
        """Whether the tokens on the host already end in an n-gram seen before: repetitive
        text stays repetitive from one token to the next far more often than not."""
        return bool(self._ngram.propose(self._tokens(request, request.num_known_tokens), 1))

    def _tokens(self, request: SequenceState, length: int) -> np.ndarray:
        entry = self._histories.get(request.request_id)
        if entry is None or entry[0] is not request:
            entry = self._histories[request.request_id] = (request, TokenHistory())
        return entry[1].tokens(request.token_ids, length)
