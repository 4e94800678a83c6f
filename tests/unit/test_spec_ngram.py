"""The n-gram (prompt lookup) proposer: exact drafts for exact contexts."""

from __future__ import annotations

from meshserve.services.worker.spec.ngram import NgramProposer


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
