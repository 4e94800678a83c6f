"""The mesh tax on CPU: 32 concurrent streaming requests through the gateway, next to
`run-batch` (the in-process engine) on the same requests, in one run.

    python loadtest/bench_mesh_cpu.py --out loadtest/reports/mesh_cpu.json

Both sides run the same chat requests with greedy sampling and a fixed output
length (ignore_eos), on the same model and engine settings. The stack runs one
worker so that it is comparable with the single in-process engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import openai
import torch

from meshserve.services.launcher import LauncherConfig, start_stack
from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.batch import run_batch
from meshserve.services.worker.engine.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.offline import OfflineLLM

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Give three tips for better sleep.", "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.", "What is a prime number?",
]


def requests(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]
            for i in range(count)]


async def one(client: openai.AsyncOpenAI, model: str, messages, max_tokens: int) -> dict:
    started = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft_s": first, "tokens": tokens, "e2e_s": time.perf_counter() - started}


async def through_gateway(base_url: str, model: str, convs, max_tokens: int) -> dict:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                  timeout=600) as client:
        await one(client, model, convs[0], 4)  # warm up the path
        started = time.perf_counter()
        rows = await asyncio.gather(*(one(client, model, c, max_tokens) for c in convs))
        elapsed = time.perf_counter() - started
    ttfts = sorted(r["ttft_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"requests": len(rows), "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed, "median_ttft_s": ttfts[len(ttfts) // 2],
            "p90_ttft_s": ttfts[int(len(ttfts) * 0.9)]}


def in_process(model: str | None, convs, max_tokens: int, workdir: Path) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu"))
    llm = OfflineLLM(engine, load_tokenizer(engine.source))
    src, dst = workdir / "in.jsonl", workdir / "out.jsonl"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": c, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}} for i, c in enumerate(convs)]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines[:1]))
    run_batch(src, dst, llm, "m", show_progress=False)  # warm up
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(src, dst, llm, "m", show_progress=False)
    return {"requests": summary.total, "output_tokens": summary.completion_tokens,
            "seconds": summary.elapsed_s,
            "output_tokens_per_s": summary.completion_tokens / summary.elapsed_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    convs = requests(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        offline = in_process(args.model, convs, args.max_tokens, Path(tmp))
        print(f"run-batch: {offline['output_tokens_per_s']:.1f} tok/s", flush=True)
        config = LauncherConfig(model=args.model, workers=1, port=0, dtype="float32",
                                device="cpu", served_model_name="bench", run_dir=tmp)
        with start_stack(config) as stack:
            mesh = asyncio.run(through_gateway(stack.base_url, "bench", convs, args.max_tokens))
    ratio = mesh["output_tokens_per_s"] / offline["output_tokens_per_s"]
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "torch": torch.__version__},
              "model": args.model or "SmolLM2-135M-Instruct (GGUF, float32)",
              "max_tokens": args.max_tokens, "concurrency": args.requests,
              "gateway_streaming": mesh, "run_batch_in_process": offline,
              "mesh_over_in_process": ratio}
    print("\n| path | requests | output tok/s | median TTFT (s) | p90 TTFT (s) |")
    print("|---|---|---|---|---|")
    print(f"| gateway, {args.requests} concurrent streams | {mesh['requests']} | "
          f"{mesh['output_tokens_per_s']:.1f} | {mesh['median_ttft_s']:.3f} | "
          f"{mesh['p90_ttft_s']:.3f} |")
    print(f"| run-batch, in process | {offline['requests']} | "
          f"{offline['output_tokens_per_s']:.1f} | - | - |")
    print(f"\nmesh keeps {100 * ratio:.1f}% of the in-process throughput")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
