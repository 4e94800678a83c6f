"""FP8 logprobs against bf16 (and both against float32) on a random model whose logits are
not flat, on the GPU paths: the skinny Triton FP8 product (decode), per-token quantization
with `torch._scaled_mm` (prefill), attention over an FP8 cache, all inside the engine with
CUDA graphs.

Driver part: `fp8` (FP8_RUNS=head).

    python3 loadtest/fp8_logprobs.py --out fp8_logprobs.json [--device cuda] [--layers 4]

The dummy-weight benchmarks (fp8_bench.py) give every token the same logprob, so they say
nothing about FP8's accuracy. Here a Llama-shaped model with unit-scale random weights
(tests/tiny_models.py; hidden 512, 8 query / 4 KV heads of 64, intermediate 1536) is built
in a temporary folder and run by five engines: float32, bf16, bf16 + FP8 weights
(`--quantization fp8`), bf16 + FP8 weights + FP8 KV cache, and bf16 + FP8 weights and LM
head (`--quantize-lm-head`). Each scores PROMPTS random
prompts of LENGTH tokens (the prompt tokens' logprobs and top-1 logprobs, from prefill) and
decodes LENGTH greedy tokens from each (logprobs at the positions where both runs still
agree on every token). The JSON has every pair's figures (fp8_bench.logprob_diffs);
tests/engine/test_fp8_engine.py holds the CPU bounds the GPU figures are read against.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "engine"))

DIMS = {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024}
RUNS = {"float32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
        "fp8": {"dtype": "bfloat16", "quantization": "fp8"},
        "fp8_kv8": {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"},
        "fp8_head": {"dtype": "bfloat16", "quantization": "fp8", "quantize_lm_head": True}}
PAIRS = (("bf16", "fp8"), ("bf16", "fp8_kv8"), ("bf16", "fp8_head"), ("float32", "bf16"),
         ("float32", "fp8"), ("float32", "fp8_kv8"), ("float32", "fp8_head"))


def score(folder: Path, device: str, prompts: int, length: int, **overrides: Any
          ) -> dict[str, Any]:
    import torch
    from fp8_bench import score_prompts

    from meshserve.services.worker.builder import build_engine
    from meshserve.services.worker.config import EngineConfig

    engine = build_engine(EngineConfig(model=str(folder), device=device, num_kv_blocks=512,
                                       **overrides))
    try:
        return score_prompts(engine, prompts, length)
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    args = p.parse_args(argv)
    import torch
    from fp8_bench import logprob_diffs
    from test_fp8_engine import (
        FP8_KV_LOGPROB_BOUND,
        FP8_LM_HEAD_LOGPROB_BOUND,
        FP8_WEIGHTS_LOGPROB_BOUND,
    )
    from tiny_models import build_tiny_model

    result: dict[str, Any] = {"device": args.device, "dims": {**DIMS, "layers": args.layers},
                              "torch": torch.__version__, "prompts": args.prompts,
                              "length": args.length,
                              "cpu_bounds": {"fp8_weights": FP8_WEIGHTS_LOGPROB_BOUND,
                                             "fp8_kv": FP8_KV_LOGPROB_BOUND,
                                             "fp8_lm_head": FP8_LM_HEAD_LOGPROB_BOUND}}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "model", "llama", seed=1,
                                  num_hidden_layers=args.layers, **DIMS)
        scored = {}
        for name, overrides in RUNS.items():
            scored[name] = score(folder, args.device, args.prompts, args.length, **overrides)
            print(f"{name}: scored", flush=True)
    result["pairs"] = {f"{a} -> {b}": logprob_diffs(scored[a], scored[b]) for a, b in PAIRS}
    for pair, d in result["pairs"].items():
        print(f"{pair}: prompt token logprob |diff| max {d['logprob_token_max_abs_diff']:.4f} "
              f"mean {d['logprob_token_mean_abs_diff']:.5f}; decode {d['decode_same_tokens']} of "
              f"{d['decode_tokens']} positions before the tokens part, |diff| max "
              f"{d['decode_logprob_max_abs_diff'] or 0:.4f}; identical requests "
              f"{d['decode_identical_requests']}/{args.prompts}", flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
