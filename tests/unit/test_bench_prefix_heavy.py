"""The prefix-heavy dataset of `meshserve bench serve` and its prompt-cache figures."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from meshserve.bench.serve import datasets, metrics
from meshserve.bench.serve.client import RequestResult
from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.workload import build_workload, prefix_heavy_set
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.errors import ConfigError

VOCAB = datasets.Vocabulary(1000, frozenset({0, 1}))


def heavy(seed: int = 3) -> datasets.PrefixHeavy:
    return datasets.prefix_heavy(40, num_tenants=6, prefix_len=48, zipf_s=1.1, question_len=5,
                                 output_len=7, vocabulary=VOCAB, seed=seed)


# ----- tenants ---------------------------------------------------------------------------
def test_tenants_follow_zipf_by_rank() -> None:
    n, tenants, s = 200_000, 8, 1.1
    drawn = datasets.zipf_tenants(n, tenants, s, seed=0)
    counts = np.bincount(drawn, minlength=tenants)
    weights = 1.0 / np.arange(1, tenants + 1) ** s
    expected = weights / weights.sum()
    # rank 1 is index 0: each rank within 2% of k^-s / H, and less popular than the one above
    np.testing.assert_allclose(counts / n, expected, rtol=0.02)
    assert all(counts[k] > counts[k + 1] for k in range(tenants - 1))
    uniform = np.bincount(datasets.zipf_tenants(n, tenants, 0.0, seed=0), minlength=tenants)
    np.testing.assert_allclose(uniform / n, 1 / tenants, rtol=0.03)


def test_tenants_are_fixed_by_the_seed() -> None:
    assert datasets.zipf_tenants(500, 32, 1.1, seed=4) == datasets.zipf_tenants(500, 32, 1.1,
                                                                                 seed=4)
    assert datasets.zipf_tenants(500, 32, 1.1, seed=4) != datasets.zipf_tenants(500, 32, 1.1,
                                                                                 seed=5)


# ----- prefixes and questions ------------------------------------------------------------
def test_tenant_prefixes_have_the_length_and_share_no_block() -> None:
    prefixes = datasets.tenant_prefixes(32, 64, VOCAB, seed=1)
    assert len(prefixes) == 32 and all(len(p) == 64 for p in prefixes)
    assert len({p[0] for p in prefixes}) == 32  # they differ from their first token
    assert not any(set(p) & VOCAB.special_ids for p in prefixes)
    block_hashes = [set(hash_blocks(p, 16)) for p in prefixes]
    assert sum(len(h) for h in block_hashes) == len(set().union(*block_hashes)) == 32 * 4
    assert prefixes == datasets.tenant_prefixes(32, 64, VOCAB, seed=1)


def test_every_id_can_start_a_tenant_but_not_one_more() -> None:
    small = datasets.Vocabulary(6, frozenset({0}))
    prefixes = datasets.tenant_prefixes(5, 3, small, seed=0)
    assert sorted(p[0] for p in prefixes) == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError) as caught:
        datasets.tenant_prefixes(6, 3, small, seed=0)
    assert caught.value.param == "prefix_tenants"


def test_questions_are_unique_even_when_the_vocabulary_allows_just_enough() -> None:
    small = datasets.Vocabulary(4, frozenset({3}))  # ids 0, 1, 2: nine questions of two
    questions = datasets.unique_questions(9, 2, small, seed=2)
    assert sorted(map(tuple, questions)) == [(a, b) for a in range(3) for b in range(3)]
    assert questions == datasets.unique_questions(9, 2, small, seed=2)
    with pytest.raises(ConfigError) as caught:
        datasets.unique_questions(10, 2, small, seed=2)
    assert caught.value.param == "prefix_question_len"
    many = datasets.unique_questions(2000, 32, VOCAB, seed=0)
    assert len({tuple(q) for q in many}) == 2000 and {len(q) for q in many} == {32}


def test_prompts_are_a_tenants_prefix_and_a_question() -> None:
    workload = heavy()
    pairs = workload.prompts()
    assert pairs == heavy().prompts() and pairs != heavy(seed=4).prompts()
    assert len(pairs) == 40 and {out for _, out in pairs} == {7}
    for (prompt, _), tenant, question in zip(pairs, workload.tenants, workload.questions,
                                             strict=True):
        assert len(prompt) == 48 + 5
        assert prompt[:48] == workload.prefixes[tenant] and prompt[48:] == question
    assert len({tuple(p) for p, _ in pairs}) == 40
    assert workload.tenants.count(0) > workload.tenants.count(5)  # rank 1 is the popular one


# ----- through the bench's config --------------------------------------------------------
def test_flags_and_defaults_of_the_dataset() -> None:
    config = ServeConfig.from_args(["--dataset", "prefix-heavy", "--vocab-size", "50000"],
                                   environ={})
    assert (config.prefix_tenants, config.prefix_len, config.prefix_zipf_s,
            config.prefix_question_len, config.output_len) == (32, 2048, 1.1, 32, 64)
    assert ServeConfig(vocab_size=9).output_len == 128  # the random dataset's default
    named = ServeConfig.from_args(["--dataset", "prefix-heavy", "--vocab-size", "500",
                                   "--prefix-tenants", "4", "--prefix-len", "20",
                                   "--prefix-zipf-s", "0.5", "--prefix-question-len", "3",
                                   "--random-output-len", "9", "--num-prompts", "10",
                                   "--num-warmup", "2"], environ={})
    workload = build_workload(named)
    expected = datasets.prefix_heavy(10, num_tenants=4, prefix_len=20, zipf_s=0.5,
                                     question_len=3, output_len=9, vocabulary=workload.vocabulary,
                                     seed=0).prompts()  # type: ignore[arg-type]
    assert [(r.prompt, r.output_len) for r in workload.requests] == expected
    assert {r.prompt_len for r in workload.requests} == {23}
    # Warm-ups share no prefix with the timed prompts.
    assert len(workload.warmup) == 2 and all(w.output_len == 9 for w in workload.warmup)
    assert not {tuple(w.prompt[:20]) for w in workload.warmup} & {  # type: ignore[index]
        tuple(r.prompt[:20]) for r in workload.requests}  # type: ignore[index]


@pytest.mark.parametrize("argv, param", [
    (["--prefix-tenants", "0"], "prefix_tenants"),
    (["--prefix-len", "0"], "prefix_len"),
    (["--prefix-question-len", "0"], "prefix_question_len"),
    (["--prefix-zipf-s", "-1"], "prefix_zipf_s"),
    (["--prefix-zipf-s", "inf"], "prefix_zipf_s"),
    (["--random-output-len", "0"], "random_output_len"),
])
def test_bad_prefix_flags_name_the_flag(argv: list[str], param: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeConfig.from_args(["--dataset", "prefix-heavy", "--vocab-size", "99", *argv],
                              environ={})
    assert caught.value.param == param


def test_requests_longer_than_the_context_are_refused_up_front() -> None:
    config = ServeConfig(dataset="prefix-heavy", vocab_size=500, max_model_len=100,
                         prefix_len=64, prefix_question_len=8, random_output_len=29)
    with pytest.raises(ConfigError, match="exceed the context length 100"):
        build_workload(config)
    build_workload(ServeConfig(dataset="prefix-heavy", vocab_size=500, max_model_len=100,
                               prefix_len=64, prefix_question_len=8, random_output_len=28,
                               num_prompts=3))


def test_text_prompts_keep_each_tenants_prefix_text(tmp_path: Path) -> None:
    from tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    config = ServeConfig(dataset="prefix-heavy", tokenizer=tmp_path, prompt_format="text",
                         num_prompts=12, prefix_tenants=3, prefix_len=40, prefix_question_len=6,
                         num_warmup=0)
    workload = build_workload(config)
    tenants = prefix_heavy_set(config, workload.vocabulary, None).tenants  # type: ignore[arg-type]
    prompts = [str(r.prompt) for r in workload.requests]
    for r, prompt in zip(workload.requests, prompts, strict=True):
        assert r.prompt_len == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert r.output_len == 64
    assert len(set(prompts)) == 12
    for tenant in set(tenants):
        own = [p for p, t in zip(prompts, tenants, strict=True) if t == tenant]
        others = [p for p, t in zip(prompts, tenants, strict=True) if t != tenant]
        shared = os.path.commonprefix(own) if len(own) > 1 else own[0][:-1]
        # The tenant's prefix text (about 40 tokens) is the same in each of its prompts and in
        # no other tenant's.
        assert len(tokenizer.encode(shared, add_special_tokens=False)) >= 38
        assert not any(p.startswith(shared) for p in others)


# ----- prompt-cache figures --------------------------------------------------------------
def test_cached_tokens_sum_and_fraction_by_hand() -> None:
    def done(prompt: int, cached: int | None, usage_prompt: int | None = None) -> RequestResult:
        return RequestResult(success=True, status=200, prompt_len=prompt, output_tokens=2,
                             ttft=0.1, latency=0.2, itl=[0.1], cached_tokens=cached,
                             usage_prompt_tokens=usage_prompt)

    outputs = [done(100, 0), done(100, 96), done(50, 32, usage_prompt=60),
               RequestResult(success=False, status=500, error="x", cached_tokens=None)]
    r = metrics.run_result(outputs, 1.0)
    assert r["total_cached_tokens"] == 128
    assert r["cached_token_fraction"] == pytest.approx(128 / 260)  # the server's 60, not 50
    assert r["cached_tokens"] == [0, 96, 32, None]
    unreported = metrics.run_result([done(100, None)], 1.0)
    assert unreported["total_cached_tokens"] is None
    assert unreported["cached_token_fraction"] is None
