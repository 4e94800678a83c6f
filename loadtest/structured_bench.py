"""Structured outputs' cost: a batch where half the requests follow a JSON schema against
the same batch without any, and the grammar compile time of each schema.

Driver part: `structured`.

    python loadtest/structured_bench.py --model /tmp/llama8b --load-format dummy \\
        --requests 256 --max-tokens 256 --out structured.json

Both batches produce exactly requests x max_tokens tokens: the free requests ignore EOS,
and the constrained ones follow schemas that cannot be complete within max_tokens (long
arrays), so only the cost of masking differs. Grammars are compiled before the timed runs
(their compile times are reported on their own, the first one including the vocabulary
scan xgrammar makes once per model). Each batch runs --repeats times, alternating; the
best run of each counts.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.structured.grammars import GrammarCompiler
from meshserve.services.worker.structured.hook import StructuredOutputsHook
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.structured_outputs import StructuredKind, StructuredOutputs

# Constrained requests cycle through these; none can be complete within a few hundred
# tokens, so every request produces max_tokens tokens.
RUN_SCHEMAS: list[dict[str, Any]] = [
    {"type": "array", "minItems": 500, "items": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}},
    {"type": "object", "properties": {
        "rows": {"type": "array", "minItems": 200, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                           "ok": {"type": "boolean"}},
            "required": ["id", "name", "ok"]}}},
     "required": ["rows"]},
    {"type": "array", "minItems": 300, "items": {"enum": ["red", "green", "blue", None]}},
    {"type": "array", "minItems": 300, "items": {"type": "number"}},
]
# Schemas of the kind applications send, for compile times.
COMPILE_SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1}, "email": {"type": "string"},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}}},
            "required": ["id", "email"]},
        "created": {"type": "string", "format": "date-time"},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0,
                                              "maximum": 1}, "maxItems": 10}},
        "required": ["user"]},
    "tool_call": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {
            "name": {"const": f"tool_{i}"},
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"}, "limit": {"type": "integer"},
                "mode": {"enum": ["fast", "exact"]}}, "required": ["query"]}},
         "required": ["name", "parameters"]} for i in range(8)]}},
    "run_schemas": RUN_SCHEMAS[1],
}


def main() -> None:
    args = _parse_args()
    engine = build_engine(EngineConfig(model=args.model, load_format=args.load_format,
                                       device=args.device, dtype=args.dtype,
                                       max_num_seqs=args.requests))
    report: dict[str, Any] = {"command": vars(args), "environment": _environment(engine)}
    report["compile_ms"] = _compile_times(engine)
    print("compile ms:", report["compile_ms"], flush=True)
    specs = [StructuredOutputs.json_schema(s) for s in RUN_SCHEMAS]
    for spec in specs:
        _grammars(engine).compile(spec)
    rng = random.Random(0)
    low = min(1000, engine.model_config.vocab_size // 4)
    prompts = [[rng.randrange(low, engine.model_config.vocab_size - 512)
                for _ in range(args.prompt_len)] for _ in range(args.requests)]
    half = [specs[(i // 2) % len(specs)] if i % 2 == 0 else None
            for i in range(args.requests)]
    # Warm-up at full size (kernels, graphs and sampler paths of every batch shape).
    _run(engine, prompts, [None] * args.requests, 16)
    _run(engine, prompts, half, 16)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "half_json_schema": []}
    for repeat in range(args.repeats):
        for name, constraints in (("free", [None] * args.requests),
                                  ("half_json_schema", half)):
            result = _run(engine, prompts, constraints, args.max_tokens)
            runs[name].append(result)
            print(f"repeat {repeat} {name}: {result}", flush=True)
    best = {name: max(r["output_tok_s"] for r in results) for name, results in runs.items()}
    report["runs"] = runs
    report["best_output_tok_s"] = best
    report["ratio"] = best["half_json_schema"] / best["free"]
    print(f"half json_schema / free: {report['ratio']:.3f}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


def _run(engine: LLMEngine, prompts: list[list[int]], constraints: list[StructuredOutputs |
         None], max_tokens: int) -> dict[str, float]:
    """Run one batch to the end; its output tokens, wall time and rate."""
    for i, (prompt, spec) in enumerate(zip(prompts, constraints, strict=True)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
            structured=spec))
    tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - started
    expected = len(prompts) * max_tokens
    assert tokens == expected, f"the batch produced {tokens} tokens, not {expected}"
    return {"output_tokens": tokens, "seconds": round(elapsed, 3),
            "output_tok_s": round(tokens / elapsed, 1)}


def _grammars(engine: LLMEngine) -> GrammarCompiler:
    """The engine's grammar compiler (its structured-outputs hook's)."""
    hook = engine.hook(StructuredOutputsHook)
    assert hook is not None, "the engine has no structured outputs"
    return hook.grammars


def _compile_times(engine: LLMEngine) -> dict[str, float]:
    """Milliseconds to compile each schema on a fresh cache (the first entry, a trivial
    regex, includes loading the tokenizer and xgrammar's vocabulary scan)."""
    grammars = _grammars(engine)
    times: dict[str, float] = {}
    started = time.perf_counter()
    grammars.compile(StructuredOutputs(StructuredKind.REGEX, "[a-z]+"))
    times["first_use_tokenizer_scan"] = round((time.perf_counter() - started) * 1e3, 1)
    for name, schema in COMPILE_SCHEMAS.items():
        started = time.perf_counter()
        grammars.compile(StructuredOutputs.json_schema(schema))
        times[name] = round((time.perf_counter() - started) * 1e3, 1)
        started = time.perf_counter()
        grammars.compile(StructuredOutputs.json_schema(schema))
        times[f"{name}_cached"] = round((time.perf_counter() - started) * 1e3, 3)
    return times


def _environment(engine: LLMEngine) -> dict[str, Any]:
    from importlib.metadata import version

    import transformers
    import xgrammar  # noqa: F401 (its version is in pip metadata)

    device = engine.device
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "xgrammar": version("xgrammar"), "python": platform.python_version(),
            "model": engine.source.name, "vocab_size": engine.model_config.vocab_size,
            "dtype": str(engine.dtype), "async_scheduling": engine.async_scheduling}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="structured.json")
    return parser.parse_args()


if __name__ == "__main__":
    main()
