"""Benchmark prompts as token ids: random, ShareGPT-like, prefix-heavy and long-prompt, fixed
by a seed.

Torch-free, and shared by both benchmarks: `meshserve bench throughput` feeds these prompts to
the in-process engine and `meshserve bench serve` sends them over HTTP, so one seed gives both
the same token prompts (compare the two side by side).

    lengths = sharegpt_like_lengths(1000, seed, max_model_len)
    prompts = random_prompts([i for i, _ in lengths], vocab.size, vocab.special_ids, seed)

Token ids are uniform over the vocabulary minus the special ids (eos and bos): one flat draw
of numpy's PCG64 (`np.random.default_rng(seed)`), split by the lengths.

The prefix-heavy set is a multi-tenant load for prefix-aware routing: tenants with their own
system prompts (no block in common), popular by a Zipf law, each request adding its question:

    heavy = prefix_heavy(1000, num_tenants=32, prefix_len=2048, zipf_s=1.1, question_len=32,
                         output_len=64, vocabulary=vocab, seed=seed)
    pairs = heavy.prompts()     # [(prefixes[tenant] + question, 64), ...]

The long-prompt set is RAG-like traffic for disaggregated serving: long prompts (retrieved
documents and a question, 2-8k tokens), short answers (64-256), each length uniform over its
range, the prompt range cut to what the context leaves after the longest answer:

    pairs = long_prompt_lengths(1000, (2048, 8192), (64, 256), max_model_len, seed)
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
    ModelFiles,
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
_TENANT_STREAM = 5  # 4 is the runner's arrival times
_LONG_PROMPT_STREAM = 6


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
    """vocab_size, eos ids, bos id and context length of a model folder (`--model-config`)."""
    try:
        return facts_of(read_folder(folder))
    except (MeshError, KeyError, TypeError, ValueError) as exc:
        message = exc.message if isinstance(exc, MeshError) else f"bad or missing field {exc}"
        raise ConfigError(f"--model-config {folder}: {message}", param="model_config") from exc


def facts_of(files: ModelFiles) -> ModelFacts:
    """The facts of a model's config files, read as the worker reads them (eos: config's and
    generation config's, united; bos: config's, else the generation config's), so that the
    special ids match the in-process engine's. KeyError etc. on a bad config."""
    cfg, generation = files.config, files.generation or {}
    vocab_size = int(cfg["vocab_size"])
    max_model_len = max_model_len_of(files)
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


def long_prompt_lengths(num_prompts: int, input_range: tuple[int, int],
                        output_range: tuple[int, int], max_model_len: int | None, seed: int
                        ) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs of the long-prompt set, the same for a seed: each length
    uniform over its inclusive range. The prompt range's top is cut to `max_model_len` minus
    the longest answer, so that every request fits the context; ConfigError when even the
    shortest prompt would not (the server would refuse every request)."""
    (in_low, in_high), (out_low, out_high) = input_range, output_range
    if max_model_len is not None:
        if in_low + out_high > max_model_len:
            raise ConfigError(f"long-prompt requests of at least {in_low} prompt and up to "
                              f"{out_high} output tokens exceed the context length "
                              f"{max_model_len}: lower --long-prompt-min-len or "
                              f"--long-prompt-max-output-len", param="long_prompt_min_len")
        in_high = min(in_high, max_model_len - out_high)
    rng = np.random.default_rng((seed, _LONG_PROMPT_STREAM))
    inputs: list[int] = rng.integers(in_low, in_high + 1, size=num_prompts).tolist()
    outputs: list[int] = rng.integers(out_low, out_high + 1, size=num_prompts).tolist()
    return list(zip(inputs, outputs, strict=True))


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


def zipf_tenants(num_prompts: int, num_tenants: int, s: float, seed: int) -> list[int]:
    """The tenant of each request, fixed by `seed`: index k (rank k + 1) with probability
    proportional to 1 / (k + 1)^s over the `num_tenants` tenants (a Zipf law cut at N; s 0 is
    uniform). Index 0 is the most popular tenant."""
    weights = 1.0 / np.arange(1, num_tenants + 1, dtype=float) ** s
    rng = np.random.default_rng((seed, _TENANT_STREAM))
    drawn: list[int] = rng.choice(num_tenants, size=num_prompts, p=weights / weights.sum()
                                  ).tolist()
    return drawn


def tenant_prefixes(num_tenants: int, prefix_len: int, vocabulary: Vocabulary, seed: int
                    ) -> list[list[int]]:
    """One random prefix (a system prompt) per tenant, each starting with an id no other
    tenant's starts with: chained block hashes then share no block between tenants."""
    allowed = _allowed_ids(vocabulary.size, vocabulary.special_ids)
    if num_tenants > allowed.size:
        raise ConfigError(f"{num_tenants} tenants need as many distinct first ids; the "
                          f"vocabulary has {allowed.size}", param="prefix_tenants")
    rng = np.random.default_rng((seed, _PREFIX_STREAM))
    firsts: list[int] = rng.choice(allowed, size=num_tenants, replace=False).tolist()
    rests = _draw([prefix_len - 1] * num_tenants, allowed, rng)
    return [[first, *rest] for first, rest in zip(firsts, rests, strict=True)]


def unique_questions(num_prompts: int, question_len: int, vocabulary: Vocabulary, seed: int
                     ) -> list[list[int]]:
    """`num_prompts` distinct random questions of `question_len` ids, fixed by `seed`: a
    repeated question would make a whole prompt a cache hit."""
    allowed = _allowed_ids(vocabulary.size, vocabulary.special_ids)
    if int(allowed.size) ** question_len < num_prompts:
        raise ConfigError(f"{num_prompts} distinct questions of {question_len} ids do not "
                          f"exist in a vocabulary of {allowed.size}",
                          param="prefix_question_len")
    rng = np.random.default_rng((seed, _SUFFIX_STREAM))
    questions = _draw([question_len] * num_prompts, allowed, rng)
    seen: set[tuple[int, ...]] = set()
    for i, question in enumerate(questions):
        while tuple(question) in seen:  # rare for real lengths: draw again from the stream
            question = _draw([question_len], allowed, rng)[0]
        questions[i] = question
        seen.add(tuple(question))
    return questions


@dataclass(frozen=True)
class PrefixHeavy:
    """A multi-tenant workload: per request, a tenant's shared prefix, then its question."""

    prefixes: list[list[int]]  # one per tenant, most popular first
    tenants: list[int]  # each request's tenant (an index into `prefixes`)
    questions: list[list[int]]  # each request's own question
    output_len: int

    def prompts(self) -> list[tuple[list[int], int]]:
        """(prompt ids, output_len) of every request, in order."""
        return [(self.prefixes[t] + q, self.output_len)
                for t, q in zip(self.tenants, self.questions, strict=True)]


def prefix_heavy(num_prompts: int, *, num_tenants: int, prefix_len: int, zipf_s: float,
                 question_len: int, output_len: int, vocabulary: Vocabulary, seed: int
                 ) -> PrefixHeavy:
    """`num_tenants` system prompts of `prefix_len` ids, no two sharing a block; each request
    picks a tenant by Zipf(`zipf_s`) and adds a distinct question of `question_len` ids."""
    return PrefixHeavy(tenant_prefixes(num_tenants, prefix_len, vocabulary, seed),
                       zipf_tenants(num_prompts, num_tenants, zipf_s, seed),
                       unique_questions(num_prompts, question_len, vocabulary, seed),
                       output_len)
