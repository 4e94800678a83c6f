"""The n-gram (prompt lookup) proposer: exact drafts for exact contexts."""

from __future__ import annotations

import random

from meshserve.services.worker.engine.sequence import SequenceState, SequenceStatus
from meshserve.services.worker.spec.decoder import NgramBatchProposer
from meshserve.services.worker.spec.ngram import NgramProposer, TokenHistory
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.speculative_config import SpeculativeConfig


def test_latest_occurrence_of_the_longest_suffix_wins() -> None:
    proposer = NgramProposer(k=3, min_n=1, max_n=3)
    # The 3-gram suffix [1, 2, 3] occurs at 0 (then 9, 1, 2) and at 4 (then 4, 5, 2): the
    # latest wins; the later 2-gram [2, 3] at 9 (then 7, 1, 2) loses to the longer match.
    context = [1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3, 7, 1, 2, 3]
    assert proposer.propose(context) == [4, 5, 2]


def test_longer_suffix_beats_a_later_shorter_one() -> None:
    proposer = NgramProposer(k=2, min_n=1, max_n=2)
    # [8, 5] occurs once (followed by 6, 7); [5] alone occurs later (followed by 0).
    assert proposer.propose([8, 5, 6, 7, 5, 0, 8, 5]) == [6, 7]


def test_draft_stops_at_the_end_of_the_context() -> None:
    proposer = NgramProposer(k=5, min_n=1, max_n=2)
    # [1, 2] occurred at 0, then the context holds only 3 more tokens after it.
    assert proposer.propose([1, 2, 1, 2]) == [1, 2]
    assert proposer.propose([4, 4, 4]) == [4]


def test_no_match_or_too_short_gives_no_draft() -> None:
    proposer = NgramProposer(k=3, min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    assert proposer.propose([7, 7]) == []  # a 2-gram needs an earlier occurrence
    assert proposer.propose([]) == []


def test_k_caps_the_draft() -> None:
    proposer = NgramProposer(k=4, min_n=1, max_n=1)
    context = [5, 1, 2, 3, 4, 5]
    assert proposer.propose(context) == [1, 2, 3, 4]
    assert proposer.propose(context, k=2) == [1, 2]
    assert proposer.propose(context, k=9) == [1, 2, 3, 4]
    assert proposer.propose(context, k=0) == []


def _brute_force(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: longest suffix first, latest earlier occurrence."""
    if len(context) < min_n + 1:
        return []
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - 1 - n, -1, -1):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


def test_lookup_agrees_with_the_definition_on_many_contexts() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        # Small vocabularies: many repeats, matches of every length, overlapping ones.
        context = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 3)
        max_n, k = rng.randint(min_n, 5), rng.randint(1, 5)
        proposer = NgramProposer(k=k, min_n=min_n, max_n=max_n)
        assert proposer.propose(context) == _brute_force(context, k, min_n, max_n), context


def test_a_history_reads_only_new_tokens_and_restarts_when_shorter() -> None:
    tokens = list(range(300))
    asked: list[tuple[int, int]] = []

    def read(start: int, end: int) -> list[int]:
        asked.append((start, end))
        return tokens[start:end]

    history = TokenHistory()
    assert history.tokens(read, 5).tolist() == tokens[:5]
    assert history.tokens(read, 290).tolist() == tokens[:290]  # grows past its buffer
    assert history.tokens(read, 290).tolist() == tokens[:290]  # nothing new: not read
    assert asked == [(0, 5), (5, 290)]
    tokens[:3] = [7, 7, 7]
    assert history.tokens(read, 3).tolist() == [7, 7, 7]  # shorter: taken again
    assert asked[-1] == (0, 3)


def test_the_batch_proposer_follows_each_sequence_and_forgets_finished_ones() -> None:
    config = SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1)
    proposer = NgramBatchProposer(config)
    loop = SequenceState("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(), max_tokens=20)
    other = SequenceState("b", [5, 6, 7], SamplingParams(), max_tokens=20)
    assert proposer.propose_batch([loop, other], [3, 3]) == [[3, 1, 2], []]
    loop.output_token_ids.extend([3, 9, 1])  # the sequence grows: drafts follow it
    assert proposer.propose_batch([loop], [3]) == [[2, 3, 9]]
    assert proposer.may_draft(loop) and not proposer.may_draft(other)
    other.status = SequenceStatus.FINISHED_STOPPED
    proposer.propose_batch([loop], [2])
    assert set(proposer._histories) == {"a"}
