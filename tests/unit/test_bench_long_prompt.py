"""The long-prompt dataset of `meshserve bench serve`: RAG-like prompt and answer lengths."""

from __future__ import annotations

import pytest

from meshserve.bench.serve import datasets
from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.workload import build_workload
from meshserve.shared.errors import ConfigError

RANGES = ((2048, 8192), (64, 256))


def test_lengths_lie_in_their_ranges_and_cover_them() -> None:
    pairs = datasets.long_prompt_lengths(5000, *RANGES, None, seed=0)
    inputs, outputs = [i for i, _ in pairs], [o for _, o in pairs]
    assert 2048 <= min(inputs) and max(inputs) <= 8192
    assert 64 <= min(outputs) and max(outputs) <= 256
    # Uniform over the range: both ends reached closely, the mean near the middle.
    assert min(inputs) < 2100 and max(inputs) > 8140
    assert min(outputs) == 64 and max(outputs) == 256
    assert abs(sum(inputs) / len(inputs) - 5120) < 100
    assert abs(sum(outputs) / len(outputs) - 160) < 4


def test_lengths_are_fixed_by_the_seed() -> None:
    first = datasets.long_prompt_lengths(200, *RANGES, None, seed=7)
    assert first == datasets.long_prompt_lengths(200, *RANGES, None, seed=7)
    assert first != datasets.long_prompt_lengths(200, *RANGES, None, seed=8)
    assert datasets.long_prompt_lengths(1, (9, 9), (3, 3), None, seed=1) == [(9, 3)]


def test_prompts_are_cut_to_what_the_context_leaves_after_the_longest_answer() -> None:
    pairs = datasets.long_prompt_lengths(2000, *RANGES, 4096, seed=0)
    assert max(i for i, _ in pairs) <= 4096 - 256 and min(i for i, _ in pairs) >= 2048
    assert max(i + o for i, o in pairs) <= 4096
    # Exactly enough room: every prompt at the shortest length.
    tight = datasets.long_prompt_lengths(100, *RANGES, 2048 + 256, seed=0)
    assert {i for i, _ in tight} == {2048}


def test_a_context_below_the_range_is_refused_with_the_flags_to_change() -> None:
    with pytest.raises(ConfigError, match="exceed the context length 2303") as caught:
        datasets.long_prompt_lengths(10, *RANGES, 2048 + 255, seed=0)
    assert caught.value.param == "long_prompt_min_len"
    assert "--long-prompt-min-len" in caught.value.message
    config = ServeConfig(dataset="long-prompt", vocab_size=500, max_model_len=1024,
                         num_prompts=3)
    with pytest.raises(ConfigError, match="context length 1024"):
        build_workload(config)


def test_flags_defaults_and_the_workload() -> None:
    config = ServeConfig.from_args(["--dataset", "long-prompt", "--vocab-size", "500"],
                                   environ={})
    assert config.long_prompt_ranges == RANGES
    named = ServeConfig.from_args(
        ["--dataset", "long-prompt", "--vocab-size", "500", "--long-prompt-min-len", "30",
         "--long-prompt-max-len", "90", "--long-prompt-min-output-len", "5",
         "--long-prompt-max-output-len", "9", "--num-prompts", "40", "--seed", "3",
         "--max-model-len", "80", "--num-warmup", "2"], environ={})
    workload = build_workload(named)
    expected = datasets.long_prompt_lengths(40, (30, 90), (5, 9), 80, seed=3)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == expected
    assert all(len(r.prompt) == r.prompt_len for r in workload.requests)  # type: ignore[arg-type]
    assert all(0 <= t < 500 for r in workload.requests for t in r.prompt)  # type: ignore[union-attr]
    # Distinct prompts: retrieved documents, not a shared prefix.
    assert len({tuple(r.prompt[:8]) for r in workload.requests}) == 40  # type: ignore[index]
    assert [w.prompt_len for w in workload.warmup] == [i for i, _ in expected[:2]]


@pytest.mark.parametrize("argv, param", [
    (["--long-prompt-min-len", "0"], "long_prompt_min_len"),
    (["--long-prompt-min-len", "9000"], "long_prompt_max_len"),
    (["--long-prompt-min-output-len", "0"], "long_prompt_min_output_len"),
    (["--long-prompt-max-output-len", "63"], "long_prompt_max_output_len"),
])
def test_bad_ranges_name_the_flag(argv: list[str], param: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeConfig.from_args(["--dataset", "long-prompt", "--vocab-size", "99", *argv],
                              environ={})
    assert caught.value.param == param
