"""Piecewise CUDA graphs' pieces, run eagerly on the CPU: the cut at attention, the static
buffers and the padding to token buckets must not change what the model computes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.cuda_graphs import PiecewiseGraphRunner, token_buckets
from meshserve.shared.sampling_params import SamplingParams


def test_token_buckets_pad_by_less_than_a_quarter() -> None:
    buckets = token_buckets(2048)
    assert buckets[0] == 16 and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    for t in range(17, 2049):
        bucket = next(b for b in buckets if b >= t)
        assert bucket - t < max(16, t / 4), t
    assert token_buckets(100)[-1] == 100 and token_buckets(16) == [16]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v2", "deepseek_v3"])
def test_pieces_give_the_eager_outputs(tmp_path: Path, arch: str) -> None:
    folder = build_tiny_model(tmp_path, arch, seed=2)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 40, 17, 63, 1, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = []
    for piecewise in (False, True):
        engine = build_engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                        num_kv_blocks=128, max_num_batched_tokens=48,
                                        async_scheduling="on"))
        used = []
        if piecewise:
            runner = PiecewiseGraphRunner(engine.runner.model, engine.runner.kv_caches,
                                          max_tokens=48, device=engine.device)
            engine.runner.pieces = runner
            run = runner.run

            def spy(ids, positions, meta, run=run, used=used):  # type: ignore[no-untyped-def]
                used.append(ids.shape[0])
                return run(ids, positions, meta)

            runner.run = spy  # type: ignore[method-assign]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_logprobs or [])
        results.append(out)
        if piecewise:
            # Every step went through the pieces (48 tokens at most), with padded sizes.
            assert used and max(used) <= 48
            assert any(t not in runner.buckets for t in used)
    eager, pieces = results
    for key in eager:
        assert [e.token_id for e in pieces[key]] == [e.token_id for e in eager[key]], key
        for a, b in zip(eager[key], pieces[key]):
            assert abs(a.logprob - b.logprob) < 1e-4
