"""Whole-step graphs for speculative verify steps, run uncaptured on the CPU: the (batch
bucket, q) choice, the static buffers and the padding sequences must not change a token."""

from __future__ import annotations

import json
import random

import pytest
from engine_features import speculation_of
from test_engine_vs_hf import make_engine, run_all, tokens_of
from tiny_models import build_tiny_model

from meshserve.services.worker.engine.cuda_graphs import (
    VERIFY_GRAPH_MAX_SEQS,
    CudaGraphRunner,
    batch_buckets,
    verify_graph_key,
)
from meshserve.shared.sampling_params import SamplingParams

K = 3
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1})


def test_verify_graph_key_needs_one_captured_query_length() -> None:
    buckets = batch_buckets(256)
    lens = (2, 3, 4, 5)
    assert verify_graph_key([5], lens, buckets) == (1, 5)
    assert verify_graph_key([3, 3, 3], lens, buckets) == (4, 3)
    assert verify_graph_key([2] * 9, lens, buckets) == (16, 2)
    assert verify_graph_key([5, 4], lens, buckets) is None  # mixed lengths: piecewise
    assert verify_graph_key([6], lens, buckets) is None  # more drafts than captured
    assert verify_graph_key([1, 1], lens, buckets) is None  # decode: the decode graphs
    assert verify_graph_key([5] * VERIFY_GRAPH_MAX_SEQS, lens, buckets) == (
        VERIFY_GRAPH_MAX_SEQS, 5)
    assert verify_graph_key([5] * (VERIFY_GRAPH_MAX_SEQS + 1), lens, buckets) is None
    assert verify_graph_key([], lens, buckets) is None


def test_graph_keys_cover_decode_and_verify_largest_first(tmp_path) -> None:
    engine = make_engine(build_tiny_model(tmp_path, "llama", seed=3), max_num_seqs=8)
    runner = CudaGraphRunner(engine.runner.model, engine.runner.kv_caches, max_num_seqs=8,
                             max_blocks_per_seq=4, max_model_len=64, hidden_size=64,
                             device=engine.device, verify_lens=(2, 3))
    keys = runner.keys()
    assert set(keys) == {(b, q) for b in (1, 2, 4, 8) for q in (1, 2, 3)}
    sizes = [b * q for b, q in keys]
    assert sizes == sorted(sizes, reverse=True)  # smaller graphs reuse the largest's pool
    assert runner.input_ids.shape[0] == 8 * 3


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_verify_steps_through_the_graph_runner_give_the_same_tokens(tmp_path,
                                                                    num_prompts: int) -> None:
    folder = build_tiny_model(tmp_path, "llama", seed=1)
    rng = random.Random(4)
    loop = [rng.randrange(3, 400) for _ in range(6)]
    # The same prompt for every sequence: the same drafts, so one query length per step.
    prompts = [loop * 5] * num_prompts
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = run_all(make_engine(folder), prompts, params)

    engine = make_engine(folder, speculative_config=NGRAM)
    runner = CudaGraphRunner(engine.runner.model, engine.runner.kv_caches,
                             max_num_seqs=engine.max_num_seqs,
                             max_blocks_per_seq=engine.kv.blocks_needed(engine.max_model_len),
                             max_model_len=engine.max_model_len, hidden_size=64,
                             device=engine.device, verify_lens=tuple(range(2, K + 2)))
    engine.runner.graphs = runner  # uncaptured: the padded forwards run eagerly
    keys: list[tuple[int, int]] = []
    run = runner.run

    def spy(ids, positions, meta):  # type: ignore[no-untyped-def]
        keys.append(runner.verify_key(meta) if not meta.decode_only else (0, 1))
        return run(ids, positions, meta)

    runner.run = spy  # type: ignore[method-assign]
    outputs = run_all(engine, prompts, params)
    for i in range(num_prompts):
        assert tokens_of(outputs[f"r{i}"]) == tokens_of(reference[f"r{i}"]), i
    verify = [key for key in keys if key[1] > 1]
    assert verify, "no verify step went through the graph runner"
    assert all(key is not None for key in keys)
    if num_prompts == 3:  # three sequences run in the bucket of four: one padding sequence
        assert any(key[0] == 4 for key in verify)
    assert speculation_of(engine) is not None and speculation_of(engine).stats.snapshot()[2] > 0  # drafts accepted
