"""Multi-LoRA with tensor parallelism on CPU (gloo, 2 ranks) against transformers + peft.

Rank 1 is a real follower process; each rank holds its part of every adapter (B's rows of
the column-parallel projections, A's columns of the row-parallel ones) and rank 0's slot
writes reach it with the step that needs them, runtime-loaded adapters included.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from engine_features import lora_of
from lora_adapters import build_adapter, greedy, peft_model
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.loader import load_model_config, resolve_model
from meshserve.services.worker.lora.weights import load_lora_weights, shard_lora_weights
from meshserve.services.worker.parallel.config import ParallelConfig, ShardPlan
from meshserve.shared.lora_config import LoraModule
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _engine(base: Path, tp: int, **overrides: object) -> LLMEngine:
    cfg: dict[str, object] = {"model": str(base), "dtype": "float32", "device": "cpu",
                              "num_kv_blocks": 96, "tensor_parallel_size": tp,
                              "structured_outputs_backend": "none", "enable_lora": True,
                              "max_num_batched_tokens": 64}
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def _run(engine: LLMEngine, requests: list[tuple[list[int], int | None]]) -> list[list[int]]:
    got: dict[str, list[int]] = {}
    for i, (prompt, lora_id) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_id=lora_id)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(requests))]


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 30))] for _ in range(count)]


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: the KV head is replicated on both ranks
def test_two_ranks_serve_adapters_as_peft_does(tmp_path: Path, kv_heads: int) -> None:
    base = build_tiny_model(tmp_path / "base", "llama", seed=4, num_key_value_heads=kv_heads)
    first = build_adapter(base, tmp_path / "a0", seed=20, rank=8)
    second = build_adapter(base, tmp_path / "a1", seed=21, rank=4, alpha=8,
                           targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    one, two = LoraModule("ad0", str(first)), LoraModule("ad1", str(second))
    # One slot for two adapters: they take turns in it, so rank 0 writes it several times.
    engine = _engine(base, 2, max_loras=1, lora_modules=f"{one.name}={one.path}",
                     async_scheduling="on")
    try:
        assert lora_of(engine) is not None and engine.ranks is not None
        lora_of(engine).add(two)  # at run time, as the gateway's load_lora_adapter does
        hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        references = [hf_base, peft_model(base, first), peft_model(base, second)]
        ids = [None, one.lora_id, two.lora_id]
        prompts = _prompts(6, hf_base.config.vocab_size)
        requests = [(p, ids[i % 3]) for i, p in enumerate(prompts)]
        got = _run(engine, requests)
    finally:
        engine.close()
    for i, (prompt, _) in enumerate(requests):
        assert got[i] == greedy(references[i % 3], prompt, MAX_NEW), f"request {i}"
    # The adapters change the tokens: the comparison above is not only the base model's.
    assert [greedy(hf_base, prompts[i], MAX_NEW) for i in (1, 2)] != got[1:3]


def test_each_rank_holds_its_part_of_an_adapter(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", "llama", seed=5)
    adapter = build_adapter(base, tmp_path / "a", seed=30, rank=4)
    config = load_model_config(resolve_model(str(base), "auto"))
    weights = load_lora_weights(adapter, config, max_rank=8)
    parts = [shard_lora_weights(weights, ShardPlan(config, ParallelConfig(2, rank)))
             for rank in range(2)]
    for key, lora_a in weights.a.items():
        lora_b = weights.b[key]
        if key[1] in ("o_proj", "down_proj"):  # input split: A's columns, B whole
            assert torch.equal(torch.cat([p.a[key] for p in parts], dim=1), lora_a)
            assert all(torch.equal(p.b[key], lora_b) for p in parts)
        else:  # output split: B's rows, A whole
            assert torch.equal(torch.cat([p.b[key] for p in parts], dim=0), lora_b)
            assert all(torch.equal(p.a[key], lora_a) for p in parts)
