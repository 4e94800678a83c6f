"""What one step's tokens mean for their sequences: whether a token finishes its sequence
(a stop token, EOS, the length limits, a completed grammar) and the delta sent for it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from meshserve.services.worker.engine.sequence import SequenceOutput, SequenceState, SequenceStatus
from meshserve.services.worker.engine.structured_output import accept_tokens

log = logging.getLogger(__name__)


def stop_status(seq: SequenceState, token: int, count: int, max_model_len: int,
                ) -> SequenceStatus | None:
    """How the sequence finishes with `token` as its output token number `count`, or None
    if it goes on."""
    params = seq.params
    if count >= params.min_tokens:
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in seq.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
    if count >= seq.max_tokens or seq.num_prompt_tokens + count >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


def accept_grammar_tokens(sampled: Sequence[tuple[SequenceState, int, Any]]) -> dict[int, bool]:
    """Feed each constrained sequence's new token to its grammar, in one batch; by
    sequence identity, whether the grammar took it."""
    rows = [(seq, token) for seq, token, _ in sampled
            if seq.grammar is not None and not seq.is_finished]
    if not rows:
        return {}
    taken = accept_tokens([seq.grammar for seq, _ in rows], [token for _, token in rows])
    return {id(seq): ok for (seq, _), ok in zip(rows, taken, strict=True)}


def grammar_status(seq: SequenceState, token: int, accepted: bool) -> SequenceStatus | None:
    """FINISHED_STOPPED once the sequence's grammar is complete (or, which the mask
    prevents, has rejected `token`)."""
    if not accepted:
        log.warning("%s: grammar rejected token %d; finishing the sequence",
                    seq.request_id, token)
        return SequenceStatus.FINISHED_STOPPED
    matcher: Any = seq.grammar
    return SequenceStatus.FINISHED_STOPPED if matcher.is_terminated() else None


def delta_output(seq: SequenceState, tokens: list[int], logprobs: object = None,
                 count: int | None = None) -> SequenceOutput:
    """The delta of `tokens`, which end at output token number `count` (default: the last
    known one)."""
    if count is None:
        count = seq.num_output_tokens - seq.num_pending
    prompt_logprobs = None
    if seq.params.prompt_logprobs is not None and count == len(tokens) == 1:
        prompt_logprobs = seq.prompt_logprobs or [None]
    return SequenceOutput(
        request_id=seq.group_id,
        group_id=seq.group_id,
        index=seq.index,
        new_token_ids=tokens,
        new_logprobs=[logprobs] if logprobs is not None else None,  # type: ignore[list-item]
        prompt_logprobs=prompt_logprobs,
        finish_reason=seq.status.value if seq.is_finished else None,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        # Of the prompt only: a resumed sequence may also hit on its earlier output.
        num_cached_tokens=min(max(seq.num_cached_tokens, 0), seq.num_prompt_tokens),
        num_output_tokens=count,
    )
