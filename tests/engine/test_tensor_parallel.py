"""Tensor parallelism on CPU (gloo, 2 ranks) against one rank and against transformers.

Rank 1 runs as a real child process (parallel/follower.py), as in a worker; the engine in
this process is rank 0. Tiny random-weight models from tests/tiny_models.py.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch
from engine_features import speculation_of
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.parallel.ranks import RankGroup
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)


def make_engine(folder: Path, tp: int, **overrides: object) -> LLMEngine:
    cfg: dict[str, object] = {"model": str(folder), "dtype": "float32", "device": "cpu",
                              "num_kv_blocks": 64, "tensor_parallel_size": tp,
                              "structured_outputs_backend": "none"}
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[SequenceOutput]]:
    """All prompts to completion, the second one added after the first step (a batch that
    mixes a prefill with a decode)."""
    outputs: dict[str, list[SequenceOutput]] = {}
    engine.add_request("r0", prompts[0], PARAMS)
    pending = [(f"r{i}", p) for i, p in enumerate(prompts[1:], start=1)]
    while pending or engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if pending:
            engine.add_request(*pending.pop(0), PARAMS)
    return outputs


def tokens(outs: list[SequenceOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def logprobs(outs: list[SequenceOutput]) -> list[TokenLogprobs]:
    return [lp for o in outs for lp in (o.new_logprobs or []) if lp is not None]


def hf_greedy(folder: Path, prompt: list[int]) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 37, 18)]


def alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two safetensors shards: each rank reads its slices of both.
    return build_tiny_model(tmp_path_factory.mktemp("tp-llama"), "llama", seed=1, shards=2)


def test_two_ranks_match_one_rank_and_transformers(llama: Path) -> None:
    prompts = prompts_for(448)
    one = run(make_engine(llama, 1), prompts)
    # The overlapped loop on: tokens sampled on rank 0's device reach rank 1 by broadcast.
    engine = make_engine(llama, 2, async_scheduling="on")
    assert engine.ranks is not None
    pids = engine.ranks.pids
    try:
        two = run(engine, prompts)
    finally:
        engine.close()
    assert not any(alive(pid) for pid in pids), "rank 1 outlived engine.close()"
    for i, prompt in enumerate(prompts):
        request = f"r{i}"
        assert tokens(two[request]) == tokens(one[request]) == hf_greedy(llama, prompt)
        pairs = list(zip(logprobs(two[request]), logprobs(one[request]), strict=True))
        assert len(pairs) == MAX_NEW
        for a, b in pairs:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        prompt_two = [e for e in two[request][0].prompt_logprobs or [] if e is not None]
        prompt_one = [e for e in one[request][0].prompt_logprobs or [] if e is not None]
        assert len(prompt_two) == len(prompt) - 1
        for a, b in zip(prompt_two, prompt_one, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_one_kv_head_odd_vocabulary_tied_embeddings_and_output_bias(
        tmp_path: Path) -> None:
    """1 KV head over 2 ranks (replicated), 451 vocabulary rows (one padding row on rank 1),
    tied embeddings (the LM head is the vocabulary-parallel embedding) and an o_proj bias
    (added once, after the sum over ranks)."""
    folder = build_tiny_model(tmp_path / "m", "llama", seed=2, vocab_size=451,
                              num_key_value_heads=1, tie_word_embeddings=True,
                              attention_bias=True)
    prompts = prompts_for(451)[:2]
    engine = make_engine(folder, 2)
    try:
        assert engine.runner.kv_caches[0][0].shape[2] == 1  # one KV head on each rank
        assert engine.runner.model.model.embed_tokens.weight.shape[0] == 226
        out = run(engine, prompts)
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        assert tokens(out[f"r{i}"]) == hf_greedy(folder, prompt)


def test_a_failing_rank_is_reported_with_its_number_and_exit_code(tmp_path: Path) -> None:
    """Rank 1 fails to build its engine (no model there): rank 0 hears which rank and how."""
    failures: list[tuple[int, int]] = []
    done = threading.Event()

    def on_failure(rank: int, code: int) -> None:
        failures.append((rank, code))
        done.set()

    config = EngineConfig(model=str(tmp_path / "missing"), device="cpu",
                          tensor_parallel_size=2)
    group = RankGroup.start(config, torch.device("cpu"), on_failure=on_failure)
    try:
        assert done.wait(120), "rank 1's failure was not reported"
    finally:
        group.stop()
    assert failures == [(1, 1)]


def test_a_size_that_does_not_split_the_model_is_refused_before_any_rank_starts(
        llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_start(*args: object, **kwargs: object) -> RankGroup:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(RankGroup, "start", no_start)
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 3 must divide the "
                                             "model's 4 attention heads"):
        make_engine(llama, 3)


def test_ngram_speculation_at_two_ranks_matches_one_rank_without_it(llama: Path) -> None:
    """Verify steps at TP=2: rank 1 runs the same forward and the same verify logits (the
    vocabulary gather is collective), rank 0 verifies. Greedy tokens and their logprobs
    equal one rank's without speculation, with drafts accepted, in both loops."""
    ngram = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
             '"prompt_lookup_min": 1}')
    rng = random.Random(8)
    loop = [rng.randrange(3, 448) for _ in range(6)]
    prompts = [loop * 5, loop * 3 + [rng.randrange(3, 448) for _ in range(7)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    def generate(engine: LLMEngine) -> dict[str, list[SequenceOutput]]:
        outputs: dict[str, list[SequenceOutput]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        return outputs

    one = generate(make_engine(llama, 1))
    for loop_mode in ("off", "on"):
        engine = make_engine(llama, 2, speculative_config=ngram, async_scheduling=loop_mode)
        try:
            two = generate(engine)
            assert speculation_of(engine) is not None
            _, drafted, accepted, _ = speculation_of(engine).stats.snapshot()
        finally:
            engine.close()
        assert drafted > 0 and accepted > 0, loop_mode
        for request in one:
            assert tokens(two[request]) == tokens(one[request]), (loop_mode, request)
            for a, b in zip(logprobs(two[request]), logprobs(one[request]), strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
