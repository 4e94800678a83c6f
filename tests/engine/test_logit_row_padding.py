"""The LM head's padded row counts (GPU engines pad the rows they compute logits for, so
that cuBLAS sees few distinct sizes; see `CausalLM.compute_logits`), run here on the CPU by
switching the padding on: the same tokens and logprobs as without it, and the warm-up runs
each padded size once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model

from meshserve.kernels.linear import SKINNY_MAX_ROWS
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.models.llama import LOGITS_ROW_BUCKET, padded_logit_rows
from meshserve.shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("pad"), "llama", seed=3)


def test_padded_row_counts() -> None:
    assert [padded_logit_rows(r) for r in range(1, SKINNY_MAX_ROWS + 1)] == list(
        range(1, SKINNY_MAX_ROWS + 1))  # the skinny kernel's rows stay as they are
    assert padded_logit_rows(SKINNY_MAX_ROWS + 1) == LOGITS_ROW_BUCKET
    assert padded_logit_rows(LOGITS_ROW_BUCKET) == LOGITS_ROW_BUCKET
    assert padded_logit_rows(LOGITS_ROW_BUCKET + 1) == 2 * LOGITS_ROW_BUCKET


def run(folder: Path, pad: bool) -> tuple[LLMEngine, dict[str, tuple[list[int], list[float]]]]:
    engine = build_engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                    num_kv_blocks=128, max_num_seqs=80))
    assert engine.runner.model.pad_logit_rows is False  # off on CPUs
    engine.runner.model.pad_logit_rows = pad
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for i in range(70):  # 70 rows sample at once: padded to 128 with the padding on
        engine.add_request(f"r{i}", [rng.randrange(3, 300) for _ in range(rng.randint(2, 9))],
                           params)
    got: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(70)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(e.logprob for e in out.new_logprobs or [])
    return engine, got


def test_padding_changes_no_token_and_no_logprob(folder: Path) -> None:
    _, plain = run(folder, pad=False)
    engine, padded = run(folder, pad=True)
    for key, (tokens, logprobs) in plain.items():
        assert padded[key][0] == tokens and len(tokens) == 6
        assert torch.allclose(torch.tensor(padded[key][1]), torch.tensor(logprobs), atol=1e-5)
    # The warm-up runs every padded size once: 9..80 rows -> 64 and 128.
    assert engine.runner.warm_logits(80) == 2
    engine.runner.model.pad_logit_rows = False
    assert engine.runner.warm_logits(80) == 0  # nothing to warm without padding
