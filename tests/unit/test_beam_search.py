"""BeamSearch on hand-made logprob rows, a fork's shared blocks, and beam search's fields on the
HTTP body and the wire."""

from __future__ import annotations

import math

import pytest

from meshserve.services.gateway.wire import sampling_params as sampling_params_pb
from meshserve.services.worker.engine.beam_requests import beam_sequence_params
from meshserve.services.worker.engine.beam_search import BeamSearch
from meshserve.services.worker.engine.kv_cache_manager import KVCacheManager
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.serving.wire import sampling_params_from_proto
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.openai_protocol import parse_chat_request, parse_completion_request
from meshserve.shared.sampling_params import SamplingParams

STOP = 9


def row(*top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(top[0][0], top[0][1], 1, list(top))


def test_the_first_step_fans_out_the_best_candidates() -> None:
    search = BeamSearch(2, 5, frozenset({STOP}))
    assert search.num_candidates == 4  # 2 x width with one stop token
    picks = search.step([row((1, -0.1), (2, -0.5), (3, -1.0), (4, -2.0))])
    assert picks == [(0, 1), (0, 2)]
    assert [b.token_ids for b in search.beams] == [[1], [2]]
    assert [b.cum_logprob for b in search.beams] == [-0.1, -0.5]


def test_a_stop_among_the_best_width_is_kept_with_its_length_penalty() -> None:
    search = BeamSearch(2, 5, frozenset({STOP}), length_penalty=2.0)
    search.step([row((1, -0.1), (2, -0.5), (3, -1.0), (4, -2.0))])
    # Beam [1] ends on STOP (2nd best candidate); beam [2]'s STOP is ranked 4th: not kept.
    picks = search.step([row((5, -0.2), (STOP, -0.3), (6, -3.0), (7, -3.0)),
                         row((8, -0.1), (STOP, -0.9), (6, -3.0), (7, -3.0))])
    assert picks == [(0, 5), (1, 8)]
    assert len(search.finished) == 1
    kept = search.finished[0]
    assert kept.token_ids == (1, STOP) and kept.stopped
    assert kept.score == pytest.approx((-0.1 - 0.3) / 2 ** 2.0)


def test_early_stopping_true_ends_once_width_hypotheses_are_kept() -> None:
    search = BeamSearch(2, 10, frozenset({STOP}), early_stopping=True)
    search.step([row((1, -0.1), (2, -0.2), (3, -5.0), (4, -5.0))])
    picks = search.step([row((STOP, -0.1), (5, -2.0), (6, -5.0), (7, -5.0)),
                         row((STOP, -0.1), (5, -2.0), (6, -5.0), (7, -5.0))])
    assert picks == [] and search.done
    assert [h.token_ids for h in search.results()] == [(1, STOP), (2, STOP)]


def test_early_stopping_false_goes_on_while_a_live_beam_could_win() -> None:
    # Kept: [1, STOP] (-0.2 / 2) and [2, STOP] (-0.3 / 2). The best live beam, [1, 5] at
    # -0.5, scores -0.25 at its length: it cannot win, done. With "never" (lp 1) its best is
    # -0.5 / 10 at max_tokens, above -0.15: the search goes on.
    rows = [row((1, -0.1), (2, -0.2), (3, -5.0), (4, -5.0))]
    second = [row((STOP, -0.1), (5, -0.4), (6, -5.0), (7, -5.0)),
              row((STOP, -0.1), (5, -0.6), (6, -5.0), (7, -5.0))]
    heuristic = BeamSearch(2, 10, frozenset({STOP}), early_stopping=False)
    never = BeamSearch(2, 10, frozenset({STOP}), early_stopping="never")
    for search in (heuristic, never):
        search.step(rows)
        search.step(second)
    assert heuristic.done and not never.done
    assert [h.score for h in heuristic.results()] == pytest.approx([-0.1, -0.15])


def test_the_length_limit_ends_every_beam() -> None:
    search = BeamSearch(2, 2, frozenset(), length_penalty=0.0)
    search.step([row((1, -0.1), (2, -0.2), (3, -5.0), (4, -5.0))])
    assert search.step([row((5, -0.1), (6, -0.2), (7, -5.0), (8, -5.0)),
                        row((5, -0.4), (6, -0.2), (7, -5.0), (8, -5.0))]) == []
    results = search.results()
    assert [h.token_ids for h in results] == [(1, 5), (1, 6)]
    assert not any(h.stopped for h in results)
    assert results[0].score == pytest.approx(-0.2) and math.isclose(results[0].cum_logprob, -0.2)


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beam_fields_on_the_body_and_the_wire(early_stopping: bool | str) -> None:
    body = {"model": "m", "prompt": "hi", "n": 3, "use_beam_search": True,
            "length_penalty": 0.5, "early_stopping": early_stopping}
    params = parse_completion_request(body).params
    assert (params.use_beam_search, params.n, params.length_penalty) == (True, 3, 0.5)
    assert params.early_stopping == early_stopping
    chat = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "use_beam_search": True, "early_stopping": early_stopping})
    assert chat.params.use_beam_search and chat.params.early_stopping == early_stopping
    assert sampling_params_from_proto(sampling_params_pb(params, 16)) == SamplingParams(
        n=3, max_tokens=16, use_beam_search=True, length_penalty=0.5,
        early_stopping=early_stopping)


def test_a_bad_early_stopping_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_completion_request({"model": "m", "prompt": "hi", "early_stopping": "soon"})
    assert refused.value.param == "early_stopping"


def test_each_beam_asks_for_enough_candidates_within_the_vocabulary() -> None:
    def asked(n: int, logprobs: int | None, vocab: int = 500, eos: tuple[int, ...] = (1,)
              ) -> int | None:
        params = SamplingParams(n=n, use_beam_search=True, logprobs=logprobs)
        run = beam_sequence_params(params, eos, vocab)
        assert run.n == 1 and run.greedy and run.ignore_eos and run.use_beam_search
        return run.logprobs

    assert asked(4, None) == 8  # 2 x width with one EOS id
    assert asked(4, None, eos=(1, 2, 3)) == 16  # (1 + EOS ids) x width
    assert asked(4, 12) == 12 and asked(4, -1) == -1  # what the request shows, if more
    assert asked(100, None, vocab=50) == 50


def test_a_fork_shares_the_parents_full_blocks_by_reference() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    params = SamplingParams(n=1, use_beam_search=True, temperature=0.0)
    parent = SequenceState("p", list(range(10)), params, max_tokens=8)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    assert kv.block_ids("p") == [0, 1, 2] and kv.num_free_blocks == 7
    child = SequenceState("c", parent.prompt_token_ids, params, max_tokens=8)
    child.output_token_ids = [42]
    kv.fork(parent, child)
    # The two full blocks are shared; the partial third (tokens 8, 9) is the parent's alone.
    assert kv.block_ids("c") == [0, 1] and child.num_computed_tokens == 8
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]
    assert kv.allocate_slots(child, child.num_tokens - child.num_computed_tokens)
    assert kv.block_ids("c") == [0, 1, 3] and kv.num_free_blocks == 6
    kv.free(parent)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    kv.free(child)
    assert kv.num_free_blocks == 10
