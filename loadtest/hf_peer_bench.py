"""The workloads of `meshserve bench` through transformers' `generate`: the peer to compare with.

Driver part: `peer`.

    python loadtest/hf_peer_bench.py latency --model DIR --input-len 128 --output-len 128 \
        --num-iters 5 --output-json hf_latency.json
    python loadtest/hf_peer_bench.py throughput --model DIR --num-prompts 256 \
        --input-len 1024 --output-len 128 --output-json hf_throughput.json

DIR is a Hugging Face model folder of which only config.json is read: the weights are random
(built with `AutoModelForCausalLM.from_config` on the device, then re-drawn uniformly in
+-1e-3 from the seed, as `meshserve --load-format dummy` does). Attention is "sdpa"; the KV
cache is static where the model supports one (on a GPU transformers then compiles the decode
step by itself; `--no-compile` turns that off), else dynamic, as the JSON records. Decoding is
greedy with min_new_tokens = max_new_tokens, so every row produces the full length.

latency: the same random prompts, figures and JSON keys as `meshserve bench latency` (ttft:
when generate hands out the first new tokens).
throughput: the requests run in batches of the largest size that fits: `--batch-sizes` are
tried in descending order on the first batch, which is untimed (it is also the warm-up), and a
size that runs out of memory gives way to the next. Requests are sorted by length; a batch is
left-padded to its longest prompt, runs to its longest output and is filled up to the batch
size with copies of its last prompt (constant shapes, one compilation); only the requested
tokens of real requests count. `--dataset sharegpt-like` gives every batch other shapes, which
a compiled static cache pays for in compilations.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from meshserve.bench.engine import (
    environment_info,
    latency_report,
    measure_copy_bandwidth,
    model_info,
    progress_bar,
    random_prompts,
    sharegpt_like_lengths,
    summary,
    synchronize,
    throughput_report,
    write_json,
)
from meshserve.services.worker.loader import load_model_config, resolve_model
from meshserve.services.worker.models.config import ModelConfig

_DUMMY_RANGE = 1e-3
_BATCH_SIZES = "256,128,64,32,16,8,4,2,1"


class HfPeerBench:
    """A transformers model with random weights, run through `generate` greedily."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, seed: int,
                 compile: bool) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = device
        self.model_config: ModelConfig = load_model_config(resolve_model(str(folder), "dummy"))
        hf_config = AutoConfig.from_pretrained(folder)
        with torch.device(device):  # initialise on the device: seconds, not minutes, for 8B
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                     attn_implementation="sdpa")
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-_DUMMY_RANGE, _DUMMY_RANGE, generator=generator)
        self.model = model.eval().requires_grad_(False)
        self.name = folder.name
        self.compile = compile
        self.cache_implementation = "static"
        eos = self.model_config.eos_token_ids
        self.pad_id = hf_config.pad_token_id if hf_config.pad_token_id is not None else (
            eos[0] if eos else 0)

    def generate(self, prompts: list[list[int]], new_tokens: int, streamer: Any = None) -> None:
        """One left-padded batch through `generate`, falling back once to a dynamic cache."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        kwargs = {"attention_mask": mask, "max_new_tokens": new_tokens,
                  "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": self.pad_id,
                  "disable_compile": not self.compile, "streamer": streamer}
        try:
            self.model.generate(ids, cache_implementation=self.cache_implementation, **kwargs)
        except (ValueError, NotImplementedError) as exc:
            if self.cache_implementation != "static":
                raise
            print(f"hf_peer_bench: no static cache for this model ({exc}); using a dynamic one",
                  file=sys.stderr)
            self.cache_implementation = "dynamic"
            self.model.generate(ids, cache_implementation="dynamic", **kwargs)
        synchronize(self.device)

    def timed(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(ttft, e2e) seconds of one batch."""
        timer = _FirstTokenTimer()
        started = time.perf_counter()
        self.generate(prompts, new_tokens, streamer=timer)
        e2e = time.perf_counter() - started
        assert timer.first_token_at is not None, "generate produced no tokens"
        return timer.first_token_at - started, e2e

    def latency(self, args: argparse.Namespace) -> dict[str, Any]:
        """The latency workload of `meshserve bench latency`."""
        runs, size = args.num_iters_warmup + args.num_iters, args.batch_size
        prompts = random_prompts([args.input_len] * (runs * size), self.model_config, args.seed)
        ttfts, e2es = [], []
        with progress_bar(runs, args.progress, "batch") as bar:
            for run in range(runs):
                ttft, e2e = self.timed(prompts[run * size : (run + 1) * size], args.output_len)
                if run >= args.num_iters_warmup:
                    ttfts.append(ttft)
                    e2es.append(e2e)
                bar.update(1)
        weights = model_info(self.model, self.name, "")["weight_bytes"]
        return latency_report(e2es, ttfts, input_len=args.input_len, output_len=args.output_len,
                              batch_size=size, model_config=self.model_config,
                              weight_bytes=weights,
                              copy_bandwidth=measure_copy_bandwidth(self.device))

    def throughput(self, args: argparse.Namespace) -> dict[str, Any]:
        """The throughput workload of `meshserve bench throughput`, in batches."""
        if args.dataset == "sharegpt-like":
            lengths = sharegpt_like_lengths(args.num_prompts, args.seed,
                                            self.model_config.max_model_len)
        else:
            lengths = [(args.input_len, args.output_len)] * args.num_prompts
        lengths.sort()  # similar lengths share a batch: less padding
        prompts = random_prompts([i for i, _ in lengths], self.model_config, args.seed)
        size = self._fitting_batch_size(prompts, lengths, args.batch_sizes)
        generated = 0
        started = time.perf_counter()
        with progress_bar(len(prompts), args.progress, "req") as bar:
            for start in range(0, len(prompts), size):
                batch, new_tokens = self._batch(prompts, lengths, start, size)
                self.generate(batch, new_tokens)
                generated += len(batch) * new_tokens
                bar.update(min(size, len(prompts) - start))
        report = throughput_report(len(prompts), sum(i for i, _ in lengths),
                                   sum(o for _, o in lengths), time.perf_counter() - started)
        report.update(num_preemptions=None, batch_size=size, generated_tokens=generated,
                      mean_input_len=report["input_tokens"] / len(prompts),
                      mean_output_len=report["output_tokens"] / len(prompts))
        return report

    @staticmethod
    def _batch(prompts: list[list[int]], lengths: list[tuple[int, int]], start: int,
               size: int) -> tuple[list[list[int]], int]:
        """Prompts [start, start + size), filled up to `size` with copies of the last one."""
        batch = prompts[start : start + size]
        new_tokens = max(o for _, o in lengths[start : start + size])
        return batch + [batch[-1]] * (size - len(batch)), new_tokens

    def _fitting_batch_size(self, prompts: list[list[int]], lengths: list[tuple[int, int]],
                            candidates: Sequence[int]) -> int:
        """The largest candidate whose first batch runs (untimed) without running out of memory."""
        sizes = sorted({min(c, len(prompts)) for c in candidates}, reverse=True)
        for size in sizes:
            try:
                self.generate(*self._batch(prompts, lengths, 0, size))
                return size
            except torch.OutOfMemoryError:
                print(f"hf_peer_bench: batch size {size} runs out of memory", file=sys.stderr)
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        raise MemoryError(f"not even a batch of {sizes[-1]} fits on {self.device}")


class _FirstTokenTimer:
    """A generate streamer noting when the first new tokens come out (the second `put`: the
    first hands over the prompt). `put` receives host tensors, so the time is synchronised."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for kind in ("latency", "throughput"):
        p = sub.add_parser(kind)
        p.add_argument("--model", type=Path, required=True, help="model folder (config.json)")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16",
                                                           "float32"),
                       help="auto: bfloat16 on a GPU, float32 on a CPU")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--num-iters-warmup", type=int, default=2)
        p.add_argument("--output-json", type=Path, default=None)
        p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                       help="let transformers compile the static-cache decode step on a GPU")
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--input-len", type=int, default=32 if kind == "latency" else None)
        p.add_argument("--output-len", type=int, default=128 if kind == "latency" else None)
    lat, tput = sub.choices["latency"], sub.choices["throughput"]
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=10)
    tput.add_argument("--num-prompts", type=int, default=1000)
    tput.add_argument("--dataset", choices=("fixed", "sharegpt-like"), default="fixed")
    tput.add_argument("--batch-sizes", type=_ints, default=_ints(_BATCH_SIZES),
                      help=f"batch sizes to try, largest first (default {_BATCH_SIZES})")
    args = parser.parse_args(list(argv))
    fixed = args.benchmark == "latency" or args.dataset == "fixed"
    if fixed != (args.input_len is not None and args.output_len is not None):
        parser.error("give --input-len and --output-len with --dataset fixed, neither with "
                     "--dataset sharegpt-like")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark; print its summary and write its JSON."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    bench = HfPeerBench(args.model, device, dtype, args.seed, args.compile)
    figures = bench.latency(args) if args.benchmark == "latency" else bench.throughput(args)
    result = {"benchmark": args.benchmark, "backend": "transformers", "config": vars(args),
              "environment": environment_info(device),
              "model": model_info(bench.model, bench.name, bench.model_config.architecture),
              "cache_implementation": bench.cache_implementation,
              "compiled": bench.compile and bench.cache_implementation == "static"
              and device.type == "cuda", **figures}
    print(summary(args.benchmark, result))
    write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
