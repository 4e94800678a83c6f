"""The mesh tax on CPU: 32 concurrent streaming requests through the gateway, next to
`run-batch` (the in-process engine) on the same requests, in one run.

Driver part: none (a CPU benchmark, run by hand; figures in loadtest/reports/cpu/).

    python loadtest/bench_mesh_cpu.py --out loadtest/reports/mesh_cpu.json

Both sides run the same chat requests with greedy sampling and a fixed output
length (ignore_eos), on the same model and engine settings. The stack runs one
worker so that it is comparable with the single in-process engine.
"""

from __future__ import annotations

import os

# Both sides run with the OpenMP wait policy `meshserve up` gives its services (idle threads
# sleep), set before torch loads; see docs/behaviour.md.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import torch

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.offline.llm import OfflineLLM
from meshserve.offline.run_batch import run_batch
from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Give three tips for better sleep.", "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.", "What is a prime number?",
]


def requests(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]
            for i in range(count)]


async def one(session: aiohttp.ClientSession, url: str, model: str, messages,
              max_tokens: int) -> dict:
    """One streaming chat request, read as raw SSE (a light client, as vLLM's serving
    benchmark uses, so that the load generator does not eat the cores it measures)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    started = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url, data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": first, "tokens": tokens, "e2e_s": time.perf_counter() - started}


async def through_gateway(base_url: str, model: str, convs, max_tokens: int) -> dict:
    url = f"{base_url}/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, url, model, convs[0], 4)  # warm up the path
        started = time.perf_counter()
        rows = await asyncio.gather(*(one(session, url, model, c, max_tokens) for c in convs))
        elapsed = time.perf_counter() - started
    ttfts = sorted(r["ttft_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"requests": len(rows), "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed, "median_ttft_s": ttfts[len(ttfts) // 2],
            "p90_ttft_s": ttfts[int(len(ttfts) * 0.9)]}


def in_process(model: str | None, convs, max_tokens: int, workdir: Path) -> dict:
    engine = build_engine(EngineConfig(model=model, dtype="float32", device="cpu"))
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
                          "cores": os.cpu_count(), "torch": torch.__version__,
                          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
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
