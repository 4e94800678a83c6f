"""bad_words: a word's last token is banned where the output ends with its other tokens
(vLLM's meaning), with and without a leading space; the rest of the output is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.sampler import banned_tokens
from meshserve.shared.sampling_params import SamplingParams

PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bad-words"), "llama", seed=3)


def greedy(folder: Path, bad_words: tuple[str, ...] = (), async_scheduling: str = "off"
           ) -> list[int]:
    engine = build_engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                    num_kv_blocks=128, async_scheduling=async_scheduling))
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True, bad_words=bad_words))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_banned_tokens_follow_the_words_prefixes() -> None:
    words = [(7,), (1, 2, 3), (4, 2)]
    assert banned_tokens([9, 9], words) == [7]
    assert banned_tokens([5, 1, 2], words) == [7, 3]
    assert banned_tokens([4], words) == [7, 2]
    assert banned_tokens([], words) == [7]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_bad_word_never_appears_and_the_output_before_it_is_unchanged(
        folder: Path, async_scheduling: str) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(folder)
    free = greedy(folder)
    # A word the free output writes: two of its tokens, decoded.
    start = len(free) // 3
    word = tokenizer.decode(free[start:start + 2])
    assert word.strip()
    banned = greedy(folder, (word,), async_scheduling)
    ids = [tuple(tokenizer.encode(w, add_special_tokens=False))
           for w in (word.lstrip(), " " + word.lstrip())]
    for seq in ids:
        assert not any(tuple(banned[i:i + len(seq)]) == seq for i in range(len(banned)))
    first = min(i for i in range(len(free)) if any(
        tuple(free[i:i + len(seq)]) == seq for seq in ids))
    assert banned[:first + len(min(ids, key=len)) - 1] == free[:first + len(min(ids, key=len))
                                                               - 1]
    assert banned != free
