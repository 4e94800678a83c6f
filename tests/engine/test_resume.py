"""A sequence resumed from its first k output tokens continues exactly as it would have.

A request moved from a lost worker arrives with the output tokens each unfinished
sequence had produced; the engine must count them as output (limits, penalties, the
position of a seeded draw) so that greedy and seeded sequences go on token for token.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_outputs import drain, tokens
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams

MAX_TOKENS = 24
KINDS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234,
                             max_tokens=MAX_TOKENS, ignore_eos=True),
    "greedy-penalties": SamplingParams(temperature=0.0, presence_penalty=0.8,
                                       frequency_penalty=0.6, repetition_penalty=1.3,
                                       max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded-penalties": SamplingParams(temperature=1.0, seed=77, presence_penalty=0.5,
                                       frequency_penalty=0.4, repetition_penalty=1.2,
                                       max_tokens=MAX_TOKENS, ignore_eos=True),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)


def make_engine(folder: Path, **overrides: object) -> LLMEngine:
    cfg = {"model": str(folder), "dtype": "float32", "device": "cpu", "num_kv_blocks": 256,
           "max_model_len": 256}
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def a_prompt(seed: int, size: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(size)]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_resumed_sequence_continues_token_for_token(folder: Path, kind: str,
                                                      async_scheduling: str) -> None:
    engine = make_engine(folder, async_scheduling=async_scheduling)
    prompt = a_prompt(1, 21, engine.model_config.vocab_size)
    params = KINDS[kind]
    engine.add_request("whole", prompt, params)
    whole = tokens(drain(engine)[("whole", 0)])
    assert len(whole) == MAX_TOKENS and len(set(whole)) > 1
    # 11: the resumed tokens end exactly on a block (21 + 11 = 32); 23: one token left.
    for k in (1, 5, 11, 16, 23):
        # Other requests share the steps, so the seam is also batched like any step.
        engine.add_request(f"other{k}", a_prompt(100 + k, 9, engine.model_config.vocab_size),
                           SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True))
        engine.add_request(f"resumed{k}", prompt, params, resumed={0: whole[:k]})
        outs = drain(engine)[(f"resumed{k}", 0)]
        assert tokens(outs) == whole[k:], f"resumed after {k} tokens"
        # Output numbers go on from the resumed count; usage counts all output tokens.
        assert [o.num_output_tokens for o in outs if o.new_token_ids] == list(
            range(k + 1, MAX_TOKENS + 1))
        assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == len(prompt)


def test_only_resumed_sequences_run_and_siblings_keep_their_own_draws(folder: Path) -> None:
    engine = make_engine(folder, async_scheduling="off")
    prompt = a_prompt(2, 40, engine.model_config.vocab_size)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    engine.add_request("whole", prompt, params)
    ran = drain(engine)
    whole = [tokens(ran[("whole", i)]) for i in range(3)]
    assert len({tuple(w) for w in whole}) == 3  # siblings differ
    # Sequence 1 had finished on the lost worker: it is not run again.
    engine.add_request("resumed", prompt, params, resumed={0: whole[0][:4], 2: whole[2][:17]})
    again = drain(engine)
    assert set(again) == {("resumed", 0), ("resumed", 2)}
    assert tokens(again[("resumed", 0)]) == whole[0][4:]
    assert tokens(again[("resumed", 2)]) == whole[2][17:]
    # The prefix cache held the prompt (and the resumed tokens' blocks): cached counts
    # only the prompt's tokens.
    first = again[("resumed", 2)][0]
    assert first.num_cached_tokens == len(prompt) and first.num_prompt_tokens == len(prompt)


def test_resumed_tokens_count_towards_min_tokens_and_stop_tokens(folder: Path) -> None:
    engine = make_engine(folder, async_scheduling="off")
    prompt = a_prompt(3, 12, engine.model_config.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("whole", prompt, greedy)
    whole = tokens(drain(engine)[("whole", 0)])
    stop = whole[8]
    first_stop = whole.index(stop)
    # With the stop token from position 8 on and min_tokens 8, the whole run stops at the
    # first occurrence of `stop` at or after min_tokens: resumed after 6 tokens it must too.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            stop_token_ids=(stop,), min_tokens=8)
    engine.add_request("ref", prompt, params)
    ref = drain(engine)[("ref", 0)]
    engine.add_request("resumed", prompt, params, resumed={0: tokens(ref)[:6]})
    outs = drain(engine)[("resumed", 0)]
    assert tokens(outs) == tokens(ref)[6:]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert outs[-1].num_output_tokens == len(tokens(ref)) >= max(first_stop + 1, 8)


@pytest.mark.parametrize(("resumed", "message"), [
    ({0: [5] * MAX_TOKENS}, "nothing is left"),
    ({1: [5]}, "not one of"),
    ({0: [10**6]}, "outside the vocabulary"),
    ({}, "at least one"),
])
def test_bad_resumed_sequences_are_rejected(folder: Path, resumed: dict[int, list[int]],
                                            message: str) -> None:
    engine = make_engine(folder)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.add_request("bad", [5, 6, 7], params, resumed=resumed)
    assert info.value.param == "resumed"
    assert not engine.has_unfinished_requests()
