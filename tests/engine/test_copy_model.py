"""The benchmark's copy model (loadtest/copy_model.py): greedy decoding follows its chain, and
a prompt quoting the chain gives n-gram drafts that are all accepted (some, when corrupted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from engine_features import speculation_of
from test_engine_vs_hf import make_engine, run_all, tokens_of
from tiny_models import build_tiny_model

from meshserve.shared.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
K = 4
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 1})
MAX_NEW = 40


def load_copy_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("copy_model", ROOT / "loadtest/copy_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["copy_model"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("copy"), "llama", seed=6)


def test_chain_and_quoting_prompt() -> None:
    cm = load_copy_model()
    successor = [2, 0, 3, 1]  # 0 -> 2 -> 3 -> 1 -> 0
    assert cm.chain(successor, 0, 6) == [0, 2, 3, 1, 0, 2]
    big = list(range(1, 1000)) + [0]
    prompt, answer = cm.quoting_prompt(big, 20, filler_len=5, seed=1)
    assert len(prompt) == 26 and answer[:19] == prompt[1:20]
    assert answer[0] == big[prompt[-1]] and prompt[0] == prompt[-1]
    corrupt, _ = cm.quoting_prompt(big, 20, corrupt_every=5, filler_len=5, seed=1)
    assert [i for i in range(20) if corrupt[i] != prompt[i]] == [4, 9, 14, 19]


@pytest.mark.parametrize("corrupt_every", [0, 8])
def test_greedy_follows_the_chain_with_and_without_ngram(folder: Path,
                                                         corrupt_every: int) -> None:
    cm = load_copy_model()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    results = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        engine = make_engine(folder, speculative_config=spec)
        successor = cm.make_copy_model(engine.runner.model, seed=3)
        prompt, answer = cm.quoting_prompt(successor, MAX_NEW + 8, corrupt_every, seed=2)
        results[name] = tokens_of(run_all(engine, [prompt], params)["r0"])
        assert results[name] == answer[:MAX_NEW], name
        if spec is not None:
            assert speculation_of(engine) is not None
            drafts, drafted, accepted, _ = speculation_of(engine).stats.snapshot()
            rate = accepted / drafted
            if corrupt_every:
                # Per 8 tokens: a step without drafts after the replaced token, one accepting
                # 4 of 4, one accepting 1 of 4 (5/8, less at the ends).
                assert 0.45 < rate < 0.7, rate
            else:
                assert rate == 1.0 and drafts <= MAX_NEW // K + 1
    assert results["plain"] == results["ngram"]
