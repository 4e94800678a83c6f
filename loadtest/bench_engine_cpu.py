"""In-process engine throughput on CPU, next to transformers' `generate` in the same run.

Driver part: none (a CPU benchmark, run by hand; figures in loadtest/reports/cpu/).

Runs the same chat requests (greedy, fixed output length) through the meshserve
engine at 1, 8 and 32 concurrent requests, and through transformers' `generate`
one request at a time on the same weights; prints a table and writes JSON.

    python loadtest/bench_engine_cpu.py --out loadtest/reports/engine_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Give three tips for better sleep.", "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.", "What is a prime number?",
    "Describe how a bicycle works.", "Why is the sky blue?",
    "List the planets of the solar system.", "What is machine learning?",
    "How do vaccines work?", "Translate 'good morning' into Spanish.",
    "What is the difference between weather and climate?", "Write a limerick about a cat.",
]


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"{question} Answer in detail, request {i}."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
    return prompts


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
               concurrency: int) -> dict[str, float]:
    """Closed loop: keep `concurrency` requests in flight until all prompts are done."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    produced = 0
    started = time.perf_counter()
    first_token: dict[str, float] = {}
    submitted: dict[str, float] = {}
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            submitted[f"b{i}"] = time.perf_counter()
            engine.add_request(f"b{i}", prompt, params)
            in_flight += 1
        for out in engine.step():
            produced += len(out.new_token_ids)
            first_token.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                in_flight -= 1
    elapsed = time.perf_counter() - started
    ttfts = sorted(first_token[r] - submitted[r] for r in submitted)
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": produced,
            "seconds": elapsed, "output_tokens_per_s": produced / elapsed,
            "median_ttft_s": ttfts[len(ttfts) // 2]}


def run_transformers(source, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()
    produced = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            produced += out.shape[1] - len(prompt)
    elapsed = time.perf_counter() - started
    return {"requests": len(prompts), "output_tokens": produced, "seconds": elapsed,
            "output_tokens_per_s": produced / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hf-requests", type=int, default=None,
                        help="requests for transformers (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    engine = build_engine(EngineConfig(model=args.model, dtype="float32", device="cpu"))
    tokenizer = load_tokenizer(engine.source)
    prompts = build_prompts(tokenizer, args.requests)
    run_engine(engine, prompts[:2], 4, 2)  # warm up
    rows = []
    for c in args.concurrency:
        subset = prompts if c > 1 else prompts[: max(4, args.requests // 8)]
        rows.append(run_engine(engine, subset, args.max_tokens, c))
        print(f"engine c={c}: {rows[-1]['output_tokens_per_s']:.1f} tok/s", flush=True)
    hf = run_transformers(engine.source, prompts[: args.hf_requests or args.requests],
                          args.max_tokens)
    print(f"transformers one by one: {hf['output_tokens_per_s']:.1f} tok/s", flush=True)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "model": engine.source.name, "max_tokens": args.max_tokens,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "engine": rows, "transformers_sequential": hf,
        "speedup_at_max_concurrency": rows[-1]["output_tokens_per_s"]
        / hf["output_tokens_per_s"],
    }
    print("\n| run | requests | output tok/s | median TTFT (s) |\n|---|---|---|---|")
    for r in rows:
        print(f"| meshserve engine, {r['concurrency']} concurrent | {r['requests']} | "
              f"{r['output_tokens_per_s']:.1f} | {r['median_ttft_s']:.3f} |")
    print(f"| transformers generate, one by one | {hf['requests']} | "
          f"{hf['output_tokens_per_s']:.1f} | - |")
    print(f"\nspeed-up at {rows[-1]['concurrency']} concurrent: "
          f"{result['speedup_at_max_concurrency']:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
