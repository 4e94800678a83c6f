"""The engine's sampler, checked against independent computations in plain Python/torch."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from meshserve.services.worker.engine import logits_processors as processors_module
from meshserve.services.worker.engine.sampler import (
    Sampler,
    SamplingRow,
    _argmax_chunks,
    apply_penalties,
    compute_logprobs,
    make_generator,
    split_argmax,
)
from meshserve.shared.errors import InternalError, InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Chi-square critical value at p = 0.001 for 5 degrees of freedom (6 categories).
CHI2_5DOF_P001 = 20.52


def make_row(prompt: list[int] | None = None, output: list[int] | None = None,
             stop_ids: tuple[int, ...] = (), index: int = 0, **params: object) -> SamplingRow:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    generator = make_generator(sp.seed, CPU, index) if sp.seed is not None else None
    return SamplingRow(sp, prompt or [], output or [], generator, stop_ids)


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def softmax_list(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def chi_square(counts: Counter[int], probs: list[float], draws: int) -> float:
    return sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(probs) if p > 0)


# --- processors, exact ---------------------------------------------------------------------

def test_greedy_equals_argmax_and_ties_pick_lowest_id() -> None:
    logits = random_logits(8, 64)
    logits[5] = 0.0
    logits[5, 7] = logits[5, 3] = 1.0
    out = Sampler(64, CPU).sample(logits, [make_row(temperature=0.0) for _ in range(8)])
    expected = [max(range(64), key=lambda t, r=r: (logits[r, t].item(), -t)) for r in range(8)]
    assert out.token_ids == expected
    assert out.token_ids[5] == 3
    assert out.logprobs == [None] * 8


def test_logit_bias_is_added_and_can_force_a_token() -> None:
    logits = random_logits(2, 32)
    target = int(logits[0].argmin())
    rows = [make_row(temperature=0.0, logit_bias={target: 100.0, 1: -5.0}),
            make_row(temperature=1.0, seed=3, logit_bias={target: 100.0})]
    sampler = Sampler(32, CPU)
    processed = sampler.process(logits, rows)
    expected = logits[0].clone()
    expected[target] += 100.0
    expected[1] -= 5.0
    assert torch.equal(processed[0], expected)
    assert sampler.sample(logits, rows).token_ids == [target, target]


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    eos, stop = 2, 7
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, 4] = 5.0, 4.0, 3.0
    sampler = Sampler(10, CPU)

    def step(output: list[int]) -> tuple[int, torch.Tensor]:
        row = make_row(output=output, stop_ids=(eos, stop), temperature=0.0, min_tokens=3,
                       stop_token_ids=(stop,))
        return sampler.sample(logits, [row]).token_ids[0], sampler.process(logits, [row])[0]

    token, processed = step([1, 1])
    assert token == 4
    assert processed[eos] == -math.inf and processed[stop] == -math.inf
    assert torch.equal(processed[[0, 1, 3, 4, 5, 6, 8, 9]], logits[0, [0, 1, 3, 4, 5, 6, 8, 9]])
    token, processed = step([1, 1, 1])
    assert token == eos
    assert torch.equal(processed, logits[0])


def test_allowed_token_ids_keep_only_those_tokens_in_their_rows() -> None:
    logits = random_logits(3, 40, seed=4)
    allowed = (3, 17, 29)
    rows = [make_row(temperature=0.0, allowed_token_ids=allowed), make_row(temperature=0.0),
            make_row(temperature=1.0, seed=5, allowed_token_ids=allowed)]
    processed = Sampler(40, CPU).process(logits, rows)
    outside = [t for t in range(40) if t not in allowed]
    assert torch.equal(processed[0, list(allowed)], logits[0, list(allowed)])
    assert bool((processed[0, outside] == -math.inf).all())
    assert torch.equal(processed[1], logits[1])  # the free row is untouched
    for seed in range(20):
        rows[2] = make_row(temperature=1.0, seed=seed, allowed_token_ids=allowed)
        tokens = Sampler(40, CPU).sample(logits, rows).token_ids
        assert tokens[0] == max(allowed, key=lambda t: logits[0, t].item())
        assert tokens[2] in allowed


def reference_penalties(row: list[float], prompt: list[int], output: list[int],
                        repetition: float, frequency: float, presence: float) -> list[float]:
    out = list(row)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in Counter(output).items():
        out[token] -= frequency * count + presence
    return out


PENALTY_CASES = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"frequency_penalty": 0.5},
    {"presence_penalty": -1.25},
    {"repetition_penalty": 1.2, "frequency_penalty": -0.4, "presence_penalty": 0.9},
]


@pytest.mark.parametrize("penalties", PENALTY_CASES)
def test_penalties_match_the_formulas(penalties: dict[str, float]) -> None:
    vocab = 40
    logits = random_logits(3, vocab, seed=1)
    prompt, output = [1, 2, 2, 5, 30], [5, 6, 6, 6, 39, 2]
    rows = [make_row(prompt, output, temperature=0.0, **penalties),
            make_row(prompt, output, temperature=0.0),  # no penalties: untouched
            make_row(prompt, output, temperature=0.5, **penalties)]
    processed = Sampler(vocab, CPU).process(logits, rows)
    expected = torch.tensor(reference_penalties(
        logits[0].tolist(), prompt, output, penalties.get("repetition_penalty", 1.0),
        penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0)))
    assert torch.allclose(processed[0], expected, atol=1e-5, rtol=0)
    assert torch.equal(processed[1], logits[1])
    expected2 = torch.tensor(reference_penalties(
        logits[2].tolist(), prompt, output, penalties.get("repetition_penalty", 1.0),
        penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0)))
    assert torch.allclose(processed[2], expected2 / 0.5, atol=1e-5, rtol=0)


def test_apply_penalties_rows_of_different_lengths() -> None:
    logits = random_logits(2, 16, seed=2)
    prompts, outputs = [[3], [1, 2, 3, 4]], [[], [9, 9, 15]]
    out = apply_penalties(logits, prompts, outputs, [1.5, 2.0], [0.3, 0.1], [0.2, 1.0])
    for r in range(2):
        expected = reference_penalties(logits[r].tolist(), prompts[r], outputs[r],
                                       [1.5, 2.0][r], [0.3, 0.1][r], [0.2, 1.0][r])
        assert torch.allclose(out[r], torch.tensor(expected), atol=1e-5, rtol=0)


def test_temperature_scales_logits() -> None:
    logits = random_logits(2, 20, seed=3)
    rows = [make_row(temperature=0.7), make_row(temperature=1.8)]
    processed = Sampler(20, CPU).process(logits, rows)
    assert torch.allclose(processed[0], logits[0] / 0.7, rtol=1e-6, atol=0)
    assert torch.allclose(processed[1], logits[1] / 1.8, rtol=1e-6, atol=0)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}])
def test_top_k_one_and_tiny_top_p_equal_greedy(filters: dict[str, float]) -> None:
    logits = random_logits(16, 300, seed=4, scale=0.5)  # flat: any slip shows
    rows = [make_row(temperature=1.5, seed=s, **filters) for s in range(16)]
    assert Sampler(300, CPU).sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_exactly_the_k_largest() -> None:
    vocab = 50
    logits = random_logits(3, vocab, seed=5)
    ks = [5, 1, 49]
    rows = [make_row(temperature=1.0, top_k=k) for k in ks]
    processed = Sampler(vocab, CPU).process(logits, rows)
    for r, k in enumerate(ks):
        largest = sorted(range(vocab), key=lambda t, r=r: -logits[r, t].item())[:k]
        kept = torch.isfinite(processed[r]).nonzero().flatten().tolist()
        assert kept == sorted(largest)
        assert torch.equal(processed[r, kept], logits[r, kept])


def nucleus(probs: list[float], top_p: float) -> tuple[set[int], float]:
    """The smallest set of most likely tokens with mass >= top_p, and the distance of the
    nearest cumulative sum to top_p (to keep the test away from rounding ties)."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, mass, margin = set(), 0.0, 1.0
    for token in order:
        kept.add(token)
        mass += probs[token]
        margin = min(margin, abs(mass - top_p))
        if mass >= top_p:
            break
    return kept, margin


def test_top_p_keeps_the_nucleus_after_top_k() -> None:
    vocab = 60
    logits = random_logits(2, vocab, seed=6)
    rows = [make_row(temperature=0.8, top_p=0.6), make_row(temperature=0.8, top_p=0.6, top_k=4)]
    processed = Sampler(vocab, CPU).process(logits, rows)
    scaled = (logits / 0.8).tolist()
    for r, allowed in enumerate([vocab, 4]):
        top = sorted(range(vocab), key=lambda t, r=r: -scaled[r][t])[:allowed]
        probs = softmax_list([scaled[r][t] if t in top else -math.inf for t in range(vocab)])
        expected, margin = nucleus(probs, 0.6)
        assert margin > 1e-4
        assert set(torch.isfinite(processed[r]).nonzero().flatten().tolist()) == expected


def test_min_p_drops_tokens_below_the_scaled_max() -> None:
    vocab = 40
    logits = random_logits(1, vocab, seed=7)
    processed = Sampler(vocab, CPU).process(logits, [make_row(temperature=1.5, min_p=0.2)])
    probs = softmax_list((logits[0] / 1.5).tolist())
    keep = [p if p >= 0.2 * max(probs) else 0.0 for p in probs]
    assert 1 < sum(p > 0 for p in keep) < vocab
    expected = torch.tensor([p / sum(keep) for p in keep])
    got = processed[0].softmax(dim=-1)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert torch.equal(got == 0, expected == 0)


# --- sampling distribution ------------------------------------------------------------------

DIST_LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_the_softmax(seeded: bool) -> None:
    draws = 4000
    logits = torch.tensor([DIST_LOGITS] * draws)
    rows = [make_row(temperature=1.0, seed=i if seeded else None) for i in range(draws)]
    tokens = Sampler(6, CPU, seed=11).sample(logits, rows).token_ids
    assert chi_square(Counter(tokens), softmax_list(DIST_LOGITS), draws) < CHI2_5DOF_P001
    # The statistic does reject a wrong distribution of the same draws.
    assert chi_square(Counter(tokens), [1 / 6] * 6, draws) > 10 * CHI2_5DOF_P001


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.3}])
def test_filtered_tokens_are_never_drawn(filters: dict[str, float]) -> None:
    draws = 4000
    logits = torch.tensor([DIST_LOGITS] * draws)
    rows = [make_row(temperature=1.0, seed=i, **filters) for i in range(draws)]
    counts = Counter(Sampler(6, CPU).sample(logits, rows).token_ids)
    probs = softmax_list(DIST_LOGITS)
    allowed_by = {"top_k": {0, 1, 2}, "top_p": nucleus(probs, 0.8)[0],
                  "min_p": {t for t, p in enumerate(probs) if p >= 0.3 * max(probs)}}
    allowed = allowed_by[next(iter(filters))]
    assert set(counts) <= allowed and len(allowed) < 6
    kept = softmax_list([v if t in allowed else -math.inf for t, v in enumerate(DIST_LOGITS)])
    assert chi_square(counts, kept, draws) < CHI2_5DOF_P001


# --- seeds ----------------------------------------------------------------------------------

TARGETS = [
    {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "seed": 1234,
     "logprobs": 2},
    # top_k only: a partial top-k alone, a full sort beside top_p rows in the batch.
    {"temperature": 1.3, "top_k": 25, "presence_penalty": 0.5, "seed": 99},
]


def others(count: int, vocab: int) -> list[dict[str, object]]:
    kinds: list[dict[str, object]] = [
        {"temperature": 0.0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8},
        {"temperature": 1.0, "frequency_penalty": 1.0, "repetition_penalty": 1.4},
        {"temperature": 0.6, "top_p": 0.5, "seed": 8}, {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 1.1, "top_k": vocab // 2}, {"temperature": 0.0, "presence_penalty": 2.0},
    ]
    return [kinds[i % len(kinds)] for i in range(count)]


def run_steps(target: dict[str, object], position: int | None, steps: int = 6) -> list[int]:
    """Tokens of the target row over `steps`, alone or at `position` in a batch of 32."""
    vocab, batch = 512, 32
    specs = [target] if position is None else others(batch - 1, vocab)
    if position is not None:
        specs.insert(position, target)
    rows = [make_row([1, 2, 3, 4], [], **spec) for spec in specs]  # type: ignore[arg-type]
    me = 0 if position is None else position
    sampler = Sampler(vocab, CPU, seed=position or 0)  # unseeded rows differ between runs
    for step in range(steps):
        logits = random_logits(len(rows), vocab, seed=1000 + step * 64 + (position or 0))
        logits[me] = random_logits(1, vocab, seed=step)[0]
        out = sampler.sample(logits, rows)
        for row, token in zip(rows, out.token_ids):
            row.output_token_ids.append(token)
    return rows[me].output_token_ids


@pytest.mark.parametrize("target", TARGETS)
def test_seeded_row_is_the_same_alone_and_anywhere_in_a_batch(target: dict[str, object]) -> None:
    alone = run_steps(target, None)
    assert len(set(alone)) > 1
    for position in (0, 13, 31):
        assert run_steps(target, position) == alone


def test_different_seeds_and_sibling_indices_differ() -> None:
    logits = torch.zeros(1, 1000)

    def tokens(seed: int, index: int = 0) -> list[int]:
        row = make_row(index=index, temperature=1.0, seed=seed)
        sampler = Sampler(1000, CPU)
        return [sampler.sample(logits, [row]).token_ids[0] for _ in range(8)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert tokens(1, index=1) == tokens(1, index=1)
    assert tokens(1, index=0) != tokens(1, index=1)
    assert tokens(2, index=0) != tokens(1, index=1)
    draw = [torch.rand(4, generator=make_generator(s, CPU, i)).tolist()
            for s, i in ((5, 0), (5, 1), (5, 2), (-5, 0), (2**64 - 1, 3))]
    assert len({tuple(d) for d in draw}) == len(draw)


def test_a_seeded_draw_depends_only_on_the_seed_and_the_output_position() -> None:
    """What a seeded row drew before does not matter, nor which sampler draws: a sequence
    continued elsewhere from its first k tokens draws what it would have drawn."""
    logits = random_logits(1, 500, seed=21, scale=0.5)

    def draw(output: list[int], sampler: Sampler) -> int:
        row = make_row([1, 2], output, temperature=1.0, seed=42)
        return sampler.sample(logits, [row]).token_ids[0]

    walked = Sampler(500, CPU, seed=1)
    steps = [draw([7] * k, walked) for k in range(12)]  # one sampler, draw after draw
    assert len(set(steps)) > 6  # the position changes the draw
    for k in (0, 3, 11):
        assert draw([9] * k, Sampler(500, CPU, seed=k + 50)) == steps[k]


# --- logprobs -------------------------------------------------------------------------------

def check_entry(entry: TokenLogprobs | None, raw: torch.Tensor, token: int, count: int) -> None:
    assert entry is not None
    reference = torch.log_softmax(raw, dim=-1)
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(reference[token].item(), abs=1e-6)
    assert entry.rank == 1 + sum(v > raw[token].item() for v in raw.tolist())
    order = sorted(range(raw.numel()), key=lambda t: -raw[t].item())[:count]
    top = entry.top
    assert [t for t, _ in top] == order
    assert [v for _, v in top] == pytest.approx([reference[t].item() for t in order], abs=1e-6)
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(top))


def test_logprobs_come_from_the_raw_logits() -> None:
    vocab = 50
    logits = random_logits(4, vocab, seed=9)
    rows = [make_row([1, 2], [3], temperature=0.7, logprobs=3, logit_bias={4: 9.0},
                     repetition_penalty=1.5, seed=1),
            make_row(temperature=0.0, logprobs=0),
            make_row(temperature=0.0),
            make_row(temperature=1.0, logprobs=20, top_k=5, seed=2)]
    out = Sampler(vocab, CPU).sample(logits, rows)
    assert out.token_ids[1] == int(logits[1].argmax())
    for r, count in ((0, 3), (1, 0), (3, 20)):
        check_entry(out.logprobs[r], logits[r], out.token_ids[r], count)
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top == []  # type: ignore[union-attr]
    assert out.logprobs[2] is None


def test_compute_logprobs_for_prompt_positions() -> None:
    logits = random_logits(5, 30, seed=10)
    tokens = [0, 29, 7, int(logits[3].argmax()), int(logits[4].argmin())]
    entries = compute_logprobs(logits, torch.tensor(tokens), 4)
    for r, entry in enumerate(entries):
        check_entry(entry, logits[r], tokens[r], 4)
    assert entries[3].rank == 1 and entries[4].rank == 30


# --- batching, errors -----------------------------------------------------------------------

def test_work_no_row_needs_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("called although no row needs it")

    monkeypatch.setattr(processors_module, "_sorted_values", forbidden)
    monkeypatch.setattr(processors_module, "_token_counts", forbidden)
    logits = random_logits(4, 100, seed=12)
    sampler = Sampler(100, CPU)
    greedy = sampler.sample(logits, [make_row(temperature=0.0) for _ in range(4)])
    assert greedy.token_ids == logits.argmax(dim=-1).tolist()
    rows = [make_row(temperature=1.0, top_k=k, seed=k) for k in (1, 3, 50, 0)]
    tokens = sampler.sample(logits, rows).token_ids
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] in logits[1].topk(3).indices.tolist()


def test_realistic_vocab_mixed_batch() -> None:
    vocab = 49_152
    logits = random_logits(8, vocab, seed=13, scale=3.0)
    specs: list[dict[str, object]] = [
        {"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 50}, {"temperature": 1.0, "min_p": 0.05, "seed": 3},
        {"temperature": 0.0, "repetition_penalty": 1.2},
        {"temperature": 0.9, "top_p": 0.95, "top_k": 100, "seed": 4}, {"temperature": 1.0},
        {"temperature": 0.0, "logit_bias": {123: 100.0}},
    ]
    rows = [make_row([5, 6, 7], [8, 9], **spec) for spec in specs]  # type: ignore[arg-type]
    sampler = Sampler(vocab, CPU, seed=0)
    processed = sampler.process(logits, rows)
    out = sampler.sample(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[7] == 123
    for r, token in enumerate(out.token_ids):
        assert torch.isfinite(processed[r, token])
    assert int(torch.isfinite(processed[2]).sum()) == 50


def test_bad_inputs_raise_typed_errors() -> None:
    sampler = Sampler(10, CPU)
    with pytest.raises(InvalidRequestError) as err:
        sampler.sample(torch.zeros(1, 10), [make_row(logit_bias={10: 1.0})])
    assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as err:
        sampler.sample(torch.zeros(1, 10), [make_row(stop_ids=(12,), min_tokens=1)])
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InternalError):
        sampler.sample(torch.zeros(2, 10), [make_row()])
    with pytest.raises(InternalError):
        sampler.sample(torch.zeros(1, 10, dtype=torch.float16), [make_row()])


@pytest.mark.parametrize("chunks", [2, 7, 64])
def test_split_argmax_equals_argmax_with_ties(chunks: int) -> None:
    g = torch.Generator().manual_seed(chunks)
    vocab = 64 * 7 * 3
    x = torch.randint(-4, 4, (5, vocab), generator=g).float()  # many ties per row
    x[1] = 0.0  # a row of all ties: the lowest id, 0
    x[2, -1] = 100.0  # the max in the last chunk
    x[3, [5, vocab - 5]] = 50.0  # tied maxima in the first and last chunks: the first wins
    x[4, :] = float("-inf")
    x[4, 300] = -1e30
    got = split_argmax(x, chunks)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist()[:4] == [int(x[0].argmax()), 0, vocab - 1, 5]


def test_argmax_chunks_divide_the_vocabulary() -> None:
    for vocab in (128256, 151936, 49152, 32000, 32768):
        chunks = _argmax_chunks(vocab)
        assert chunks > 1 and vocab % chunks == 0 and vocab // chunks >= 64
    assert _argmax_chunks(1000) == 1  # small vocabularies take one argmax
    assert _argmax_chunks(65537) == 1  # a prime has no chunking
