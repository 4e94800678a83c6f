"""Engine behaviour on a tiny model: seeds, aborts, bad requests, stop conditions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_outputs import drain, tokens
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.shared.errors import ContextLengthError, InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def make_engine(folder: Path, **overrides: object) -> LLMEngine:
    cfg = {"model": str(folder), "dtype": "float32", "device": "cpu", "num_kv_blocks": 512,
               "max_model_len": 256}
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_seeded_sampling_is_reproducible_alone_and_in_a_mixed_batch(folder: Path, async_scheduling: str) -> None:
    engine = make_engine(folder, async_scheduling=async_scheduling)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    target = prompt(rng, 21, vocab)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    engine.add_request("alone", target, params)
    alone = tokens(drain(engine)[("alone", 0)])

    kinds = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=99, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.9, min_p=0.1, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=12,
                       ignore_eos=True),
    ]
    for i in range(31):
        engine.add_request(f"other{i}", prompt(rng, rng.randrange(1, 60), vocab),
                           kinds[i % len(kinds)])
        if i == 13:
            engine.add_request("in-batch", target, params)
    batched = drain(engine)
    assert tokens(batched[("in-batch", 0)]) == alone
    assert len(alone) == 12

    engine.add_request("other-seed", target, SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=12, ignore_eos=True))
    assert tokens(drain(engine)[("other-seed", 0)]) != alone


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_free_blocks_return_after_finish_and_abort_at_any_point(folder: Path, async_scheduling: str) -> None:
    engine = make_engine(folder, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    baseline = engine.kv.num_free_blocks
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.5, max_tokens=20, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", prompt(rng, 40 + i, vocab), params)
    engine.add_request("waiting", prompt(rng, 70, vocab), SamplingParams(n=2, max_tokens=8))
    seen: list[SequenceOutput] = []
    seen.extend(engine.step())  # r0 prefilled, r1 mid-prefill (chunked), the rest waiting
    assert engine.kv.num_free_blocks < baseline
    engine.abort_request("r1")
    engine.abort_request("waiting")
    engine.abort_request("unknown-id")  # ignored
    for _ in range(3):
        seen.extend(engine.step())
    engine.abort_request("r0")  # decoding
    outputs: dict[tuple[str, int], list[SequenceOutput]] = {}
    for out in seen:
        outputs.setdefault((out.request_id, out.index), []).append(out)
    for key, later in drain(engine).items():
        outputs.setdefault(key, []).extend(later)
    assert outputs[("r1", 0)][-1].finish_reason == "abort"
    assert {outputs[("waiting", i)][-1].finish_reason for i in (0, 1)} == {"abort"}
    assert outputs[("r0", 0)][-1].finish_reason == "abort"
    assert all(outputs[(f"r{i}", 0)][-1].finish_reason == "length" for i in range(2, 6))
    assert engine.kv.num_free_blocks == baseline
    assert not engine.has_unfinished_requests()


BAD_REQUESTS = [
    ([], SamplingParams(), InvalidRequestError, "prompt"),
    ([5] * 256, SamplingParams(), ContextLengthError, "prompt"),
    ([5] * 200, SamplingParams(max_tokens=100), ContextLengthError, "max_tokens"),
    ([10**7], SamplingParams(), InvalidRequestError, "prompt"),
    ([5, 6], SamplingParams(stop_token_ids=(10**7,)), InvalidRequestError, "stop_token_ids"),
]


@pytest.mark.parametrize(("ids", "params", "error", "param"), BAD_REQUESTS)
def test_bad_requests_fail_alone(folder: Path, ids, params, error, param) -> None:
    engine = make_engine(folder)
    engine.add_request("good-1", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(error) as info:
        engine.add_request("bad", ids, params)
    assert info.value.param == param
    engine.add_request("good-2", [7, 8], SamplingParams(temperature=0.0, max_tokens=4))
    outputs = drain(engine)
    assert sorted(outputs) == [("good-1", 0), ("good-2", 0)]
    assert all(len(tokens(o)) == 4 for o in outputs.values())


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 10_000}, "n"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"logprobs": -2}, "logprobs"),  # (-1: the vocabulary; the count's cap is the worker's)
])
def test_contradictory_or_out_of_range_parameters_name_the_parameter(kwargs, error) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == error


def test_logprobs_past_the_workers_max_logprobs_are_refused(folder: Path) -> None:
    engine = make_engine(folder)  # --max-logprobs 20, vLLM's default
    with pytest.raises(InvalidRequestError, match="greater than max allowed: 20") as info:
        engine.add_request("many", [4, 5], SamplingParams(max_tokens=2, logprobs=50))
    assert info.value.param == "logprobs"
    engine.add_request("twenty", [4, 5], SamplingParams(max_tokens=2, logprobs=20))


def test_duplicate_request_id_is_rejected(folder: Path) -> None:
    engine = make_engine(folder)
    engine.add_request("same", [4, 5], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        engine.add_request("same", [4, 5], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_stop_token_ids_min_tokens_and_eos(folder: Path, async_scheduling: str) -> None:
    engine = make_engine(folder, async_scheduling=async_scheduling)
    base = [9, 10, 11, 12]
    engine.add_request("free", base, SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True))
    greedy = tokens(drain(engine)[("free", 0)])
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    engine.add_request("stop", base, SamplingParams(temperature=0.0, max_tokens=12,
                                                    stop_token_ids=(stop_at,)))
    out = drain(engine)[("stop", 0)]
    assert tokens(out) == greedy[: first + 1]
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason == stop_at
    # min_tokens masks the stop id, so it cannot end the sequence early.
    engine.add_request("min", base, SamplingParams(temperature=0.0, max_tokens=12,
                                                   min_tokens=first + 2,
                                                   stop_token_ids=(stop_at,)))
    got = tokens(drain(engine)[("min", 0)])
    assert stop_at not in got[: first + 2]
    assert len(got) >= first + 2


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_priority_policy_runs_urgent_requests_first(folder: Path, async_scheduling: str) -> None:
    engine = make_engine(folder, scheduling_policy="priority", max_num_seqs=1,
                         async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", [4, 5, 6], params, priority=10)
    engine.add_request("high", [4, 5, 7], params, priority=-10)
    order: list[str] = []
    while engine.has_unfinished_requests():
        order.extend(o.request_id for o in engine.step() if o.finished)
    assert order == ["high", "low"]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_long_prompt_is_prefilled_in_capped_chunks_while_every_decode_moves(
        folder: Path, async_scheduling: str) -> None:
    engine = make_engine(folder, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                         async_scheduling=async_scheduling)
    rng = random.Random(4)
    vocab = engine.model_config.vocab_size
    decoding = [f"d{i}" for i in range(4)]
    for rid in decoding:
        engine.add_request(rid, prompt(rng, 6, vocab),
                           SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    started: set[str] = set()
    while started != set(decoding):
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    engine.add_request("long", prompt(rng, 200, vocab),
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    (long,) = engine.sequences("long")
    prefill_steps, long_tokens = 0, []
    while long.num_output_tokens == 0:  # until the step that samples its first token
        before = long.num_computed_tokens
        outputs = engine.step()
        # Every decode got its token in this step, and the long prompt at most 16 tokens.
        long_tokens += [t for o in outputs if o.request_id == "long" for t in o.new_token_ids]
        emitted = sorted(o.request_id for o in outputs
                         if o.new_token_ids and o.request_id != "long")
        assert emitted == decoding, outputs
        assert long.num_computed_tokens - before <= 16
        prefill_steps += 1
    assert prefill_steps >= 200 // 16, prefill_steps
    long_tokens += tokens(drain(engine)[("long", 0)])
    assert len(long_tokens) == 4
