"""The rejection sampler keeps the target distribution: chi-square tests of its output
against p, whatever the draft, and exact greedy behaviour."""

from __future__ import annotations

import pytest
import torch

from meshserve.services.worker.spec.rejection import RejectionSampler, accepted_lengths

VOCAB = 6
DRAWS = 6000
P_VALUE_FLOOR = 1e-3  # a correct sampler fails this one time in a thousand per test


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed `counts` [V] under `probs` [V] (cells of zero probability must
    stay empty)."""
    assert counts[probs == 0].sum() == 0, "a token of zero target probability was drawn"
    live = probs > 0
    expected = probs[live] * counts.sum()
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    dof = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         stat.double() / 2))


def target_logits() -> torch.Tensor:
    # p = softmax: uneven, with one token filtered out (-inf) as top-k would.
    return torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])


def draw_first_tokens(draft: int | None, draft_probs: torch.Tensor | None,
                      seed: int) -> tuple[torch.Tensor, float]:
    """DRAWS single-draft verifications in one batch: the emitted token of row 0 (the
    accepted draft or its correction) and the acceptance rate."""
    sampler = RejectionSampler(torch.device("cpu"), seed=seed)
    logits = target_logits().expand(DRAWS, VOCAB).clone()
    probs = None if draft_probs is None else draft_probs.expand(DRAWS, VOCAB)
    out = sampler.sample(logits, [False] * DRAWS, [draft] * DRAWS, probs)
    counts = torch.bincount(out.token_ids, minlength=VOCAB).double()
    return counts, float(out.accepted.double().mean())


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_one_hot_drafts_keep_the_target_distribution(draft: int) -> None:
    p = torch.softmax(target_logits(), dim=0)
    counts, acceptance = draw_first_tokens(draft, None, seed=draft)
    assert chi_square_p_value(counts, p) > P_VALUE_FLOOR
    # A one-hot draft is accepted with probability p(draft).
    assert abs(acceptance - float(p[draft])) < 5 * (float(p[draft]) / DRAWS) ** 0.5 + 0.01


def test_drafts_from_a_full_q_keep_the_target_distribution() -> None:
    p = torch.softmax(target_logits(), dim=0)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.5]), dim=0)
    gen = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=gen).tolist()
    sampler = RejectionSampler(torch.device("cpu"), seed=11)
    logits = target_logits().expand(DRAWS, VOCAB).clone()
    out = sampler.sample(logits, [False] * DRAWS, drafts, q.expand(DRAWS, VOCAB))
    counts = torch.bincount(out.token_ids, minlength=VOCAB).double()
    assert chi_square_p_value(counts, p) > P_VALUE_FLOOR
    # Acceptance rate of speculative sampling: sum_x min(p(x), q(x)).
    want = float(torch.minimum(p, q).sum())
    assert abs(float(out.accepted.double().mean()) - want) < 0.03


def test_bonus_rows_draw_from_p() -> None:
    p = torch.softmax(target_logits(), dim=0)
    counts, acceptance = draw_first_tokens(None, None, seed=3)
    assert acceptance == 0.0  # nothing to accept on a last row
    assert chi_square_p_value(counts, p) > P_VALUE_FLOOR


def test_greedy_rows_accept_exactly_the_argmax() -> None:
    sampler = RejectionSampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [2.0, 2.0, 1.0], [0.0, 1.0, 5.0]])
    out = sampler.sample(logits, [True] * 4, [1, 2, 0, None])
    assert out.accepted.tolist() == [True, False, True, False]
    # rejected row 1 is corrected to the argmax; the bonus row 3 is its argmax; ties go to
    # the lowest id, as the plain sampler's argmax.
    assert out.token_ids.tolist() == [1, 1, 0, 2]


def test_seeded_rows_draw_the_same_alone_or_in_a_batch() -> None:
    logits = target_logits().expand(3, VOCAB).clone()
    batch = RejectionSampler(torch.device("cpu"), seed=1).sample(
        logits, [False] * 3, [3, 3, None], seeds=[None, 77, 78])
    alone = RejectionSampler(torch.device("cpu"), seed=2).sample(
        logits[1:], [False] * 2, [3, None], seeds=[77, 78])
    assert batch.token_ids[1:].tolist() == alone.token_ids.tolist()
    assert batch.accepted[1:].tolist() == alone.accepted.tolist()


def test_accepted_lengths_stop_at_the_first_rejection() -> None:
    # sequences of 3, 0 and 2 drafts: rows [T, F, T | last], [last], [T, T | last]
    flags = [True, False, True, False, False, True, True, False]
    assert accepted_lengths(flags, [3, 0, 2]) == [1, 0, 2]
