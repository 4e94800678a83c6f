"""Structured outputs on a GPU: the overlapped loop's constrained steps and xgrammar's
Triton masking kernel, checked where CI cannot (it has no GPU).

Run by `bash loadtest/gpu.sh tests` and by the part `structured` (step `check`); the
figures go to $GPU_TEST_OUT/structured.json.

1. The masking kernel on the device gives the same logits as the CPU path, on a batch
   where only some rows are constrained.
2. A tiny random-weight model (tests/tiny_models.py) on the GPU, overlapped loop on:
   every sampled output under a JSON schema, a regex and a choice follows it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from engine_features import grammars_of
from gpu_record import record
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.structured_output import BitmaskApplier
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.structured_outputs import (
    StructuredKind,
    StructuredOutputs,
)

try:  # where the worker's structured-output package keeps it
    from meshserve.services.worker.structured.grammars import new_matcher
except ImportError:  # the engine module, before that package
    from meshserve.services.worker.structured.grammars import new_matcher

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
    "code": {"type": "string", "pattern": "^[A-Z]{2,4}$"}},
    "required": ["id", "tags", "code"]}


def kernel_check(engine: LLMEngine) -> dict[str, object]:
    spec = StructuredOutputs.json_schema(SCHEMA)
    grammar = grammars_of(engine).compile(spec)
    vocab = engine.model_config.vocab_size
    matchers = [new_matcher(grammar, []), None, new_matcher(grammar, []), None]
    matchers[2].accept_string('{"id": 1')  # a different state from row 0
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    on_cpu = logits.clone()
    BitmaskApplier(vocab, torch.device("cpu")).apply(on_cpu, matchers)
    on_gpu = logits.cuda()
    BitmaskApplier(vocab, torch.device("cuda")).apply(on_gpu, matchers)
    equal = torch.equal(on_gpu.cpu(), on_cpu)
    masked = (on_cpu == float("-inf")).sum(dim=1).tolist()
    assert equal and masked[1] == masked[3] == 0 and masked[0] > 0 and masked[2] > 0, masked
    return {"equal": equal, "masked_per_row": masked}


def generation_check(folder: Path) -> dict[str, object]:
    engine = build_engine(EngineConfig(model=str(folder), device="cuda", dtype="float32",
                                    num_kv_blocks=2048, max_model_len=2048,
                                    async_scheduling="on"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cases = {"json": (StructuredOutputs.json_schema(SCHEMA), None),
             "regex": (StructuredOutputs(StructuredKind.REGEX, r"[a-z]{3}-\d{2}"),
                       re.compile(r"[a-z]{3}-\d{2}")),
             "choice": (StructuredOutputs.choices(["up", "down"]), re.compile("up|down"))}
    for name, (spec, _) in cases.items():
        for seed in range(8):
            engine.add_request(f"{name}-{seed}", [3, 5, 7 + seed], SamplingParams(
                n=2, temperature=1.0, seed=seed, max_tokens=400, structured=spec))
    for i in range(8):  # free rows in the same batches
        engine.add_request(f"free-{i}", [4, 4, i], SamplingParams(max_tokens=64,
                                                                  ignore_eos=True))
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[(out.request_id, out.index)] = out.finish_reason
    checked = 0
    for (request_id, index), ids in tokens.items():
        name = request_id.split("-")[0]
        if name == "free":
            assert len(ids) == 64
            continue
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert reasons[(request_id, index)] == "stop", (request_id, text)
        if name == "json":
            value = json.loads(text)
            assert set(value) == {"id", "tags", "code"} and 0 <= value["id"] <= 999, text
            assert re.fullmatch("[A-Z]{2,4}", value["code"]), text
        else:
            pattern = cases[name][1]
            assert pattern is not None and pattern.fullmatch(text), (request_id, text)
        checked += 1
    return {"constrained_outputs_checked": checked, "async_scheduling": engine.async_scheduling,
            "kernel": kernel_check(engine)}


def test_structured_outputs_on_gpu(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "llama", seed=11, max_position_embeddings=2048)
    result = {"device": torch.cuda.get_device_name(), **generation_check(folder)}
    record("structured", result)
