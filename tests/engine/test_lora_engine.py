"""Multi-LoRA serving in the engine against transformers + peft on the same weights.

Adapters are PEFT folders written by peft (tests/lora_adapters.py); peft's greedy `generate`
with the adapter applied is the reference for every row, whatever else shares its steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from engine_features import lora_of, speculation_of
from lora_adapters import build_adapter, peft_model
from test_engine_vs_hf import GREEDY, hf_greedy, make_engine, tokens_of
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.errors import InvalidRequestError, NotFoundError
from meshserve.shared.lora_config import LoraModule, lora_id_for
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "base", "llama", seed=3)
    adapters = [
        build_adapter(base, root / "a0", seed=10, rank=8),
        build_adapter(base, root / "a1", seed=11, rank=4, alpha=8, use_rslora=True),
        build_adapter(base, root / "a2", seed=12, rank=16, targets=["q_proj", "v_proj",
                                                                    "down_proj"]),
    ]
    return base, adapters


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))] for _ in range(count)]


def _run(engine: LLMEngine, requests: list[tuple[list[int], int | None]]) -> list[list[int]]:
    outputs: dict[str, list] = {}
    for i, (prompt, lora_id) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_id=lora_id)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return [tokens_of(outputs[f"r{i}"]) for i in range(len(requests))]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_mixed_batch_matches_peft_per_adapter(llama: tuple[Path, list[Path]],
                                              async_scheduling: str) -> None:
    """Three adapters and the base model in one batch, with two device slots: every row
    gets its own model's greedy tokens (adapters are swapped in and out of the slots), also
    when each step is prepared before the previous one's tokens are read."""
    base, adapters = llama
    modules = tuple(LoraModule(f"ad{i}", str(p)) for i, p in enumerate(adapters))
    spec = ",".join(f"{m.name}={m.path}" for m in modules)
    engine = make_engine(base, enable_lora=True, max_loras=2, lora_modules=spec,
                         async_scheduling=async_scheduling, max_num_batched_tokens=64)
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    references = [hf_base] + [peft_model(base, p) for p in adapters]
    ids: list[int | None] = [None] + [m.lora_id for m in modules]
    prompts = _prompts(8, hf_base.config.vocab_size, seed=5)
    requests = [(p, ids[i % 4]) for i, p in enumerate(prompts)]
    got = _run(engine, requests)
    for i, (prompt, _) in enumerate(requests):
        expected = hf_greedy(references[i % 4], prompt, MAX_NEW)
        assert got[i] == expected, f"request {i} (model {i % 4})"
    # The adapters change the output: the comparison above is not the base model's.
    assert [hf_greedy(hf_base, prompts[i], MAX_NEW) for i in (1, 2, 3)] != got[1:4]


def test_adapter_cache_is_apart_from_the_base(llama: tuple[Path, list[Path]]) -> None:
    """The same prompt with and without an adapter: neither reuses the other's KV blocks."""
    base, adapters = llama
    module = LoraModule("ad0", str(adapters[0]))
    engine = make_engine(base, enable_lora=True, lora_modules=f"{module.name}={module.path}")
    prompt = _prompts(1, 400, seed=9)[0] * 3  # several full blocks
    first = _run(engine, [(prompt, None)])
    second = _run(engine, [(prompt, module.lora_id)])
    assert second[0] == hf_greedy(peft_model(base, adapters[0]), prompt, MAX_NEW)
    assert first != second


def test_qwen2_adapter_matches_peft(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", "qwen2", seed=4)
    adapter = build_adapter(base, tmp_path / "q", seed=21, rank=8)
    module = LoraModule("qwen-ad", str(adapter))
    engine = make_engine(base, enable_lora=True,  # vLLM's JSON form of --lora-modules
                         lora_modules=json.dumps({"name": module.name, "path": module.path}))
    prompts = _prompts(2, 400, seed=2)
    got = _run(engine, [(prompts[0], module.lora_id), (prompts[1], None)])
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert got[0] == hf_greedy(peft_model(base, adapter), prompts[0], MAX_NEW)
    assert got[1] == hf_greedy(hf_base, prompts[1], MAX_NEW)


def test_runtime_add_and_remove(llama: tuple[Path, list[Path]], tmp_path: Path) -> None:
    base, adapters = llama
    engine = make_engine(base, enable_lora=True)
    assert lora_of(engine) is not None
    with pytest.raises(NotFoundError):
        engine.add_request("x", [5, 6, 7], GREEDY, lora_id=lora_id_for("late"))
    lora_of(engine).add(LoraModule("late", str(adapters[1])))
    prompt = _prompts(1, 400, seed=3)[0]
    got = _run(engine, [(prompt, lora_id_for("late"))])
    assert got[0] == hf_greedy(peft_model(base, adapters[1]), prompt, MAX_NEW)
    with pytest.raises(InvalidRequestError, match="already loaded"):
        lora_of(engine).add(LoraModule("late", str(adapters[1])))
    # Removed while a request with it waits: that request still runs with it.
    engine.add_request("queued", prompt, GREEDY, lora_id=lora_id_for("late"))
    lora_of(engine).remove("late")
    with pytest.raises(NotFoundError):
        engine.add_request("y", prompt, GREEDY, lora_id=lora_id_for("late"))
    queued: list[int] = []
    while engine.has_unfinished_requests():
        queued += [t for out in engine.step() for t in out.new_token_ids]
    assert queued == got[0]
    with pytest.raises(NotFoundError, match="adapter_config.json"):
        lora_of(engine).add(LoraModule("missing", str(tmp_path / "nowhere")))
    assert [m.name for m in lora_of(engine).served()] == []


def test_rank_above_the_limit_is_refused(llama: tuple[Path, list[Path]]) -> None:
    base, adapters = llama
    engine = make_engine(base, enable_lora=True, max_lora_rank=8)
    assert lora_of(engine) is not None
    with pytest.raises(InvalidRequestError, match="max-lora-rank"):
        lora_of(engine).add(LoraModule("big", str(adapters[2])))  # rank 16


def test_steps_without_adapter_rows_skip_the_lora_kernels(
        llama: tuple[Path, list[Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step where no row has an adapter runs no LoRA kernel: eagerly the hooks return at
    once, and the decode graph runner replays its graphs captured without them (here
    uncaptured, so the padded forward runs eagerly with the same switch). Rows with
    adapters still get their adapters' tokens."""
    from meshserve.services.worker.engine.cuda_graphs import CudaGraphRunner
    from meshserve.services.worker.lora import stack as stack_module

    base, adapters = llama
    module = LoraModule("ad0", str(adapters[0]))
    engine = make_engine(base, enable_lora=True, lora_modules=f"{module.name}={module.path}")
    assert lora_of(engine) is not None
    runner = CudaGraphRunner(engine.runner.model, engine.runner.kv_caches,
                             max_num_seqs=engine.max_num_seqs,
                             max_blocks_per_seq=engine.kv.blocks_needed(engine.max_model_len),
                             max_model_len=engine.max_model_len, hidden_size=64,
                             device=engine.device, lora=lora_of(engine).stack)
    decode_keys = runner.keys()  # (bucket, tokens per sequence)
    assert {(b, q, flag) for b, q in decode_keys for flag in (True, False)} == set(
        runner.capture_keys())
    engine.runner.graphs = runner
    launched: list[int] = []
    real_add_lora = stack_module.add_lora

    def counting_add_lora(*args: object) -> None:
        launched[-1] += 1
        real_add_lora(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(stack_module, "add_lora", counting_add_lora)
    switch: list[bool] = []
    run = runner.run

    def spy(ids, positions, meta):  # type: ignore[no-untyped-def]
        switch.append(runner._lora_active())
        return run(ids, positions, meta)

    runner.run = spy  # type: ignore[method-assign]
    prompt = _prompts(1, 400, seed=8)[0]
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for lora_id, reference in ((None, hf_base), (module.lora_id, peft_model(base, adapters[0]))):
        launched.append(0)
        switch.clear()
        assert _run(engine, [(prompt, lora_id)])[0] == hf_greedy(reference, prompt, MAX_NEW)
        assert switch and set(switch) == {lora_id is not None}  # every decode step
        layers = engine.model_config.num_hidden_layers
        # The adapter's run: 4 hooked projections a layer in every step (prefill included).
        assert launched[-1] == (0 if lora_id is None else 4 * layers * (len(switch) + 1))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_ngram_speculation_with_adapters_keeps_each_models_tokens(
        llama: tuple[Path, list[Path]], async_scheduling: str) -> None:
    """--speculative-config with --enable-lora: the verify pass runs each row's adapter over
    its drafts, so greedy tokens stay each model's own (peft's for adapter rows, the base
    model's for the others) while drafts are accepted."""
    base, adapters = llama
    modules = [LoraModule(f"ad{i}", str(p)) for i, p in enumerate(adapters[:2])]
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    engine = make_engine(base, enable_lora=True, max_loras=2, speculative_config=ngram,
                         async_scheduling=async_scheduling,
                         lora_modules=",".join(f"{m.name}={m.path}" for m in modules))
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    references = [hf_base] + [peft_model(base, p) for p in adapters[:2]]
    ids: list[int | None] = [None] + [m.lora_id for m in modules]
    rng = random.Random(6)
    loop = [rng.randrange(3, 400) for _ in range(6)]
    prompts = [loop * 4, loop * 3 + [rng.randrange(3, 400) for _ in range(5)], loop * 5]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, lora_id=ids[i])
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(references[i], prompt, 40), f"request {i}"
    assert speculation_of(engine) is not None
    _, drafted, accepted, _ = speculation_of(engine).stats.snapshot()
    assert drafted > 0 and accepted > 0
