"""Beam search over one request's beams, ranked and scored as transformers' beam search does.

A request with `use_beam_search` keeps `width` live beams over its prompt. Each step every
live beam offers its top candidates; of all of them the best `num_candidates` by cumulative
logprob (2 x width, more with several stop tokens) are ranked. A candidate among the best
`width` that ends (a stop token, or the length limit) becomes a finished hypothesis, scored
cumulative_logprob / generated_length ** length_penalty, the stop token counted in the
length (transformers' count: vLLM's own loop counts the prompt too); the best `width`
hypotheses are kept. The best `width` candidates that go on are the next live beams.

`early_stopping` ends the search as transformers' does: True, as soon as `width` hypotheses
are kept; False, once the best live beam's score at its current length cannot beat the worst
kept; "never", the same at the longest length it may reach when the length penalty is
positive. The search also ends when every candidate ends (the length limit).

Pure logic: no torch, no sequences. The engine maps beams onto sequences and their shared
KV blocks (beam_requests.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshserve.shared.logprobs import TokenLogprobs

EarlyStopping = bool | str  # True, False or "never"


@dataclass
class Beam:
    """A live beam: its output tokens, their logprob entries and their summed logprob."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam. `stopped`: it ends with a stop token (else: the length limit)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    cum_logprob: float
    score: float
    stopped: bool


@dataclass(frozen=True)
class _Candidate:
    cum_logprob: float
    parent: int
    token_id: int
    entry: TokenLogprobs  # the token's logprob, rank and its parent's top alternatives


class BeamSearch:
    """The live beams and kept hypotheses of one request; `step` advances them by a token."""

    def __init__(self, width: int, max_tokens: int, stop_token_ids: frozenset[int], *,
                 length_penalty: float = 1.0, early_stopping: EarlyStopping = False) -> None:
        assert width >= 1 and max_tokens >= 1, f"width {width}, max_tokens {max_tokens}"
        assert early_stopping in (True, False, "never"), f"early_stopping {early_stopping!r}"
        self.width = width
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.beams = [Beam()]  # one beam until the first step fans out
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.num_generated = 0  # tokens of every live beam
        self.done = False

    @property
    def num_candidates(self) -> int:
        """Candidates ranked each step: enough that `width` go on even when the best all stop."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / (length ** self.length_penalty)

    def step(self, rows: Sequence[TokenLogprobs]) -> list[tuple[int, int]]:
        """Advance by one token. `rows[i]`: live beam i's next-token logprobs, its `top`
        holding at least `num_candidates` alternatives best first. Returns the next live
        beams as (parent beam index, token id), best first; empty once the search is done."""
        assert len(rows) == len(self.beams), f"{len(rows)} rows for {len(self.beams)} beams"
        ranked = self._rank(rows)
        length = self.num_generated + 1
        ends = [c.token_id in self.stop_token_ids or length >= self.max_tokens for c in ranked]
        self._keep_finished(ranked[:self.width], ends[:self.width], length)
        going = [c for c, end in zip(ranked, ends, strict=True) if not end][:self.width]
        self.num_generated = length
        if not going:
            self.done = True
            self.beams = []
            return []
        self.beams = [Beam(self.beams[c.parent].token_ids + [c.token_id],
                           self.beams[c.parent].logprobs + [c.entry], c.cum_logprob)
                      for c in going]
        self.done = self._can_stop(going[0].cum_logprob)
        return [] if self.done else [(c.parent, c.token_id) for c in going]

    def _rank(self, rows: Sequence[TokenLogprobs]) -> list[_Candidate]:
        candidates = []
        k = self.num_candidates
        for parent, (beam, row) in enumerate(zip(self.beams, rows, strict=True)):
            for rank, (token, logprob) in enumerate(row.top[:k]):
                entry = TokenLogprobs(token, logprob, rank + 1, row.top)
                candidates.append(_Candidate(beam.cum_logprob + logprob, parent, token, entry))
        # Stable: equal scores keep beam order, then rank order.
        candidates.sort(key=lambda c: -c.cum_logprob)
        return candidates[:k]

    def _keep_finished(self, best: list[_Candidate], ends: list[bool], length: int) -> None:
        """Score the best candidates that end; keep the best `width` hypotheses."""
        if len(self.finished) == self.width and self.early_stopping is True:
            return  # (the search has stopped: transformers adds nothing more)
        new = [Hypothesis(tuple(self.beams[c.parent].token_ids) + (c.token_id,),
                          tuple(self.beams[c.parent].logprobs) + (c.entry,), c.cum_logprob,
                          self.score(c.cum_logprob, length), c.token_id in self.stop_token_ids)
               for c, end in zip(best, ends, strict=True) if end]
        if new:
            merged = sorted(self.finished + new, key=lambda h: -h.score)
            self.finished = merged[:self.width]

    def _can_stop(self, best_running: float) -> bool:
        """Whether no live beam can improve on the kept hypotheses (or enough are kept)."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        return self.score(best_running, best_length) <= self.finished[-1].score

    def results(self) -> list[Hypothesis]:
        """The kept hypotheses, best first (call once `done`)."""
        assert self.done, "the beam search is still running"
        return list(self.finished)
