"""Benchmark prompts as token ids: random, ShareGPT-like and prefix-heavy, fixed by a seed.

Torch-free, and shared by both benchmarks: `meshserve bench throughput` feeds these prompts to
the in-process engine and `meshserve bench serve` sends them over HTTP, so one seed gives both
the same token prompts (compare the two side by side).

    lengths = sharegpt_like_lengths(1000, seed, max_model_len)
    prompts = random_prompts([i for i, _ in lengths], vocab.size, vocab.special_ids, seed)

Token ids are uniform over the vocabulary minus the special ids (eos and bos): one flat draw
of numpy's PCG64 (`np.random.default_rng(seed)`), split by the lengths.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.model_config import (
    bos_token_id,
    eos_token_ids,
    max_model_len_of,
    read_folder,
)

# The ShareGPT-like mix: lognormal lengths with these medians (exp(mu)) and log-space spread,
# clipped to [MIN_LEN, MAX_LEN]. sigma 0.6 puts the means at about 1.2x the medians (~240 in,
# ~215 out), near the ~200 in / ~180 out of the filtered ShareGPT set of vLLM's benchmarks.
SHAREGPT_INPUT_MEDIAN = 200
SHAREGPT_OUTPUT_MEDIAN = 180
SHAREGPT_SIGMA = 0.6
MIN_LEN = 4
MAX_LEN = 1024
# Extra SeedSequence words, so that the draws of one seed that serve different purposes
# (lengths, prefixes, suffixes) are independent streams and `random_prompts(..., seed)`
# stays the plain `default_rng(seed)` stream.
_LENGTHS_STREAM = 1
_PREFIX_STREAM = 2
_SUFFIX_STREAM = 3


@dataclass(frozen=True)
class Vocabulary:
    """The ids prompts are drawn from: [0, size) minus `special_ids`."""

    size: int
    special_ids: frozenset[int]

    def __post_init__(self) -> None:
        if self.size <= len({i for i in self.special_ids if 0 <= i < self.size}):
            raise ConfigError(f"a vocabulary of {self.size} ids has none left besides the "
                              f"special ids {sorted(self.special_ids)}", param="vocab_size")


@dataclass(frozen=True)
class ModelFacts:
    """What the prompts need from a model folder's config.json (and generation_config.json)."""

    vocabulary: Vocabulary
    max_model_len: int


def model_facts(folder: Path) -> ModelFacts:
    """vocab_size, eos ids, bos id and context length of a model folder, read as the worker
    reads them (eos: config's and generation config's, united; bos: config's, else the
    generation config's), so that the special ids match the in-process engine's."""
    try:
        files = read_folder(folder)
        cfg, generation = files.config, files.generation or {}
        vocab_size = int(cfg["vocab_size"])
        max_model_len = max_model_len_of(files)
    except (MeshError, KeyError, TypeError, ValueError) as exc:
        message = exc.message if isinstance(exc, MeshError) else f"bad or missing field {exc}"
        raise ConfigError(f"--model-config {folder}: {message}", param="model_config") from exc
    bos = bos_token_id(cfg, generation)
    special = frozenset(eos_token_ids(cfg, generation)) | frozenset(() if bos is None else (bos,))
    return ModelFacts(Vocabulary(vocab_size, special), max_model_len)


def sharegpt_like_lengths(num_prompts: int, seed: int, max_model_len: int
                          ) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs of a synthetic ShareGPT-like mix, the same for a seed.

    Each length is round(lognormal(mu=ln(median), sigma=SHAREGPT_SIGMA)) with medians 200
    (input) and 180 (output), clipped to [MIN_LEN, MAX_LEN] = [4, 1024]; then the output is cut
    to max_model_len - 4 and the input to what the output leaves of max_model_len.
    """
    if max_model_len <= MIN_LEN:
        raise ConfigError(f"max_model_len must exceed {MIN_LEN} for the ShareGPT-like mix, "
                          f"got {max_model_len}", param="max_model_len")
    rng = random.Random(seed)

    def draw(median: int) -> int:
        length = round(rng.lognormvariate(math.log(median), SHAREGPT_SIGMA))
        return min(max(length, MIN_LEN), MAX_LEN)

    pairs: list[tuple[int, int]] = []
    for _ in range(num_prompts):
        input_len, output_len = draw(SHAREGPT_INPUT_MEDIAN), draw(SHAREGPT_OUTPUT_MEDIAN)
        output_len = min(output_len, max_model_len - MIN_LEN)
        pairs.append((min(input_len, max_model_len - output_len), output_len))
    return pairs


def _allowed_ids(vocab_size: int, special_ids: Collection[int]) -> np.ndarray:
    special = np.fromiter(special_ids, dtype=np.int64, count=len(special_ids))
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), special)
    assert allowed.size > 0, f"no ids left in a vocabulary of {vocab_size} minus {special_ids}"
    return allowed


def _draw(lengths: Sequence[int], allowed: np.ndarray, rng: np.random.Generator
          ) -> list[list[int]]:
    flat: list[int] = allowed[rng.integers(allowed.size, size=sum(lengths))].tolist()
    offsets = [0, *itertools.accumulate(lengths)]
    return [flat[start:end] for start, end in itertools.pairwise(offsets)]


def random_prompts(lengths: Sequence[int], vocab_size: int, special_ids: Collection[int],
                   seed: int) -> list[list[int]]:
    """One prompt per length, fixed by `seed`: ids uniform over [0, vocab_size) minus
    `special_ids`, one flat draw of `np.random.default_rng(seed)` split by the lengths."""
    return _draw(lengths, _allowed_ids(vocab_size, special_ids), np.random.default_rng(seed))


def _uniform_lengths(rng: np.random.Generator, count: int, center: int, range_ratio: float
                     ) -> list[int]:
    """`count` integers uniform over [floor(c(1-r)), ceil(c(1+r))], at least 1 (vLLM's)."""
    low = max(math.floor(center * (1 - range_ratio)), 1)
    high = max(math.ceil(center * (1 + range_ratio)), low)
    drawn: list[int] = rng.integers(low, high + 1, size=count).tolist()
    return drawn


def random_lengths(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs of vLLM's random dataset: each uniform within
    `range_ratio` of its center; every pair is the centers when the ratio is 0."""
    rng = np.random.default_rng((seed, _LENGTHS_STREAM))
    inputs = _uniform_lengths(rng, num_prompts, input_len, range_ratio)
    outputs = _uniform_lengths(rng, num_prompts, output_len, range_ratio)
    return list(zip(inputs, outputs, strict=True))


def prefix_heavy_prompts(num_prompts: int, *, num_groups: int, prefix_len: int,
                         suffix_len: int, output_len: int, range_ratio: float,
                         vocabulary: Vocabulary, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, output_len) pairs whose prompts share one of `num_groups` random prefixes of
    `prefix_len` ids (a shared system prompt): request i takes prefix i mod num_groups, then
    its own random suffix. Suffix and output lengths vary within `range_ratio`."""
    allowed = _allowed_ids(vocabulary.size, vocabulary.special_ids)
    prefixes = _draw([prefix_len] * num_groups, allowed,
                     np.random.default_rng((seed, _PREFIX_STREAM)))
    lengths = random_lengths(num_prompts, suffix_len, output_len, range_ratio, seed)
    suffixes = _draw([s for s, _ in lengths], allowed,
                     np.random.default_rng((seed, _SUFFIX_STREAM)))
    return [(prefixes[i % num_groups] + suffix, out)
            for i, (suffix, (_, out)) in enumerate(zip(suffixes, lengths, strict=True))]
