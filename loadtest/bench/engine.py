"""`meshserve bench latency|throughput`: the in-process engine under vLLM's benchmark workloads.
(`meshserve bench serve`, the same prompts over HTTP against any OpenAI-compatible server, is
`meshserve.bench.serve`; torch and the engine load only for latency and throughput.)

    meshserve bench latency --model M --load-format dummy --input-len 128 --output-len 128
    meshserve bench throughput --model M --load-format dummy --num-prompts 1000 \
        --dataset sharegpt-like          (or --input-len 1024 --output-len 128)

Every engine flag applies; `--seed` seeds the engine and the prompts (`random_prompts`: fresh
for every request and iteration, so no timed prefill is a prefix-cache hit). Greedy with
ignore_eos: every request yields exactly its output length. latency: each batch runs alone;
e2e, ttft, tpot, the decode floor and prefill FLOP/s (`latency_report`). throughput: every
request is added at once and run to completion (`throughput_report`, preemptions, and each
request's TTFT, ITL, TPOT and e2e under bench serve's names: `TokenTimes`). Both print
a summary, show progress on stderr and write `--output-json` with config and environment;
`--save-prompts` writes the token prompts they run, for a peer engine to run the same ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm import tqdm

from meshserve.bench.serve import datasets, metrics
from meshserve.bench.serve.datasets import (  # noqa: F401 (the bench's names)
    MAX_LEN,
    MIN_LEN,
    SHAREGPT_INPUT_MEDIAN,
    SHAREGPT_OUTPUT_MEDIAN,
    SHAREGPT_SIGMA,
    sharegpt_like_lengths,
)
from meshserve.services.worker.config import EngineConfig, short_flags
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.serving.step_trace import StepRecord, device_fields, write_step_trace
from meshserve.shared.config import option
from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    # torch and the engine load in main(): `meshserve bench serve` runs without them.
    import torch

    from meshserve.services.worker.engine.engine import LLMEngine
    from meshserve.services.worker.models.config import ModelConfig

# Buffers of the copy-bandwidth probe: far above a GPU's L2 (50-60 MB) and CPU caches.
_GPU_COPY_BYTES = 1 << 30
_CPU_COPY_BYTES = 64 << 20
# Output tokens of each warm-up request (as `meshserve bench serve` warms up).
_WARMUP_OUTPUT_LEN = 16
_USAGE = ("usage: meshserve bench {latency,throughput,serve} [FLAGS]   "
          "(flags: see --help of each)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions(EngineConfig):
    """Flags every benchmark has, beside the engine's."""

    # option() returns a dataclasses.field (the default is None), not a shared mutable value.
    output_json: Path | None = option(None, "write the results as JSON here")  # noqa: RUF009
    num_iters_warmup: int = option(2, "untimed warm-up runs before measuring")
    progress: bool = option(True, "show a progress bar on stderr")
    save_prompts: Path | None = option(  # noqa: RUF009
        None, "write the prompts it runs here, one JSON line each ({\"prompt_token_ids\": "
              "[...], \"output_tokens\": N}), for a peer engine to run the same ones "
              "(loadtest/vllm_offline.py): latency's iterations, warm-up ones first; "
              "throughput's timed requests")

    def validate(self) -> None:
        super().validate()
        self.require(self.num_iters_warmup >= 0,
                     f"must be >= 0, got {self.num_iters_warmup}", "num_iters_warmup")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatencyConfig(BenchOptions):
    """Latency of one batch of random prompts at a time (greedy, fixed output length)."""

    input_len: int = option(32, "prompt tokens of each request")
    output_len: int = option(128, "output tokens of each request")
    batch_size: int = option(1, "requests run together in one iteration")
    num_iters: int = option(10, "timed iterations")

    def validate(self) -> None:
        super().validate()
        for name in ("input_len", "output_len", "batch_size", "num_iters"):
            value = getattr(self, name)
            self.require(value >= 1, f"must be >= 1, got {value}", name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThroughputConfig(BenchOptions):
    """Offline throughput: every request added at once, run to completion."""

    num_prompts: int = option(1000, "requests to run")
    dataset: Literal["fixed", "sharegpt-like"] = option(
        "fixed", "fixed: --input-len/--output-len for every request; sharegpt-like: the "
                 "synthetic ShareGPT-like length mix (median 200 in, 180 out)")
    input_len: int | None = option(None, "prompt tokens of each request (--dataset fixed)")
    output_len: int | None = option(None, "output tokens of each request (--dataset fixed)")
    num_shards: int = option(
        1, "run only every num-shards-th request of the prompt list, from --shard-index: "
           "engines in separate processes (one per GPU) share one prompt list")
    shard_index: int = option(0, "which share of the prompt list to run (see --num-shards)")
    warmup_prompts: int = option(
        8, "prompts of each warm-up batch (another seed, at most 16 output tokens each); as "
           "many as --num-prompts warms the kernels of full-size steps, as `bench serve "
           "--num-warmup` does on a server")

    def validate(self) -> None:
        super().validate()
        self.require(self.warmup_prompts >= 1, f"must be >= 1, got {self.warmup_prompts}",
                     "warmup_prompts")
        self.require(self.num_prompts >= 1, f"must be >= 1, got {self.num_prompts}",
                     "num_prompts")
        self.require(0 <= self.shard_index < self.num_shards <= self.num_prompts,
                     f"needs 0 <= shard index < shards <= prompts, got {self.shard_index} of "
                     f"{self.num_shards}", "shard_index")
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            ok = value is not None and value >= 1 if self.dataset == "fixed" else value is None
            self.require(ok, f"must be >= 1 with --dataset fixed and unset with "
                             f"--dataset sharegpt-like, got {value}", name)

    def lengths(self, max_model_len: int) -> list[tuple[int, int]]:
        """(input_len, output_len) of every request."""
        if self.dataset == "sharegpt-like":
            return sharegpt_like_lengths(self.num_prompts, self.seed, max_model_len)
        assert self.input_len is not None and self.output_len is not None
        return [(self.input_len, self.output_len)] * self.num_prompts


def random_prompts(lengths: Sequence[int], config: ModelConfig, seed: int) -> list[list[int]]:
    """One prompt per length, fixed by `seed`: ids uniform over the vocabulary minus the
    model's special ids (eos ids and bos id); `datasets.random_prompts`, which `meshserve
    bench serve` draws its token prompts from too."""
    special = set(config.eos_token_ids)
    if config.bos_token_id is not None:
        special.add(config.bos_token_id)
    return datasets.random_prompts(lengths, config.vocab_size, special, seed)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """avg, p50, p90, p99 (numpy.percentile: linear interpolation between ranks)."""
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), (50, 90, 99)).tolist()
    return {"avg": float(np.mean(values)), "p50": p50, "p90": p90, "p99": p99}


def prefill_flops(config: ModelConfig, prompt_len: int, batch_size: int = 1) -> int:
    """FLOPs of prefilling `batch_size` prompts of `prompt_len` tokens and sampling one token.

    2 x (weights of the layers' matrix products) x tokens, plus the logits of the last position
    of each prompt (2 x hidden x vocab), plus causal attention: QK^T and PV each cost
    2 x head_dim FLOPs per query head and (query, key) pair, and a causal prompt has S(S+1)/2
    pairs, so 2 x 2 x layers x heads x head_dim x S(S+1)/2. Embedding lookups are not counted.
    """
    h, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * d, config.num_key_value_heads * d
    layer_weights = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * config.intermediate_size
    linear = 2 * config.num_hidden_layers * layer_weights * prompt_len
    logits = 2 * h * config.vocab_size
    pairs = prompt_len * (prompt_len + 1) // 2
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * d * pairs
    return batch_size * (linear + logits + attention)


def latency_report(e2e: Sequence[float], ttft: Sequence[float], *, input_len: int,
                   output_len: int, batch_size: int, model_config: ModelConfig,
                   weight_bytes: int, copy_bandwidth: float,
                   read_bytes: int | None = None) -> dict[str, Any]:
    """The latency JSON's figures from per-iteration e2e and ttft seconds.

    tpot is None when output_len is 1. The floor is read_bytes (the weight bytes one decode
    token reads, `decode_read_bytes`; all of weight_bytes unless given) / copy_bandwidth
    seconds per token; the prefill's FLOP/s are `prefill_flops` over the mean ttft.
    """
    read_bytes = weight_bytes if read_bytes is None else read_bytes
    tpot = None if output_len == 1 else summarize(
        [(e - t) / (output_len - 1) for e, t in zip(e2e, ttft, strict=True)])
    floor = read_bytes / copy_bandwidth
    flops, seconds = prefill_flops(model_config, input_len, batch_size), float(np.mean(ttft))
    return {"latencies_s": list(e2e), "ttfts_s": list(ttft), "latency_s": summarize(e2e),
            "ttft_s": summarize(ttft), "tpot_s": tpot, "weight_bytes": weight_bytes,
            "read_bytes": read_bytes,
            "copy_bandwidth_bytes_per_s": copy_bandwidth, "floor_s_per_token": floor,
            "tpot_over_floor": None if tpot is None else tpot["avg"] / floor,
            "prefill": {"tokens": input_len * batch_size, "flops": flops, "seconds": seconds,
                        "flops_per_s": flops / seconds}}


def throughput_report(num_requests: int, input_tokens: int, output_tokens: int,
                      elapsed_s: float) -> dict[str, Any]:
    """requests/s, output tokens/s and total (input + output) tokens/s over `elapsed_s`."""
    return {"num_requests": num_requests, "input_tokens": input_tokens,
            "output_tokens": output_tokens, "elapsed_s": elapsed_s,
            "requests_per_s": num_requests / elapsed_s,
            "output_tokens_per_s": output_tokens / elapsed_s,
            "total_tokens_per_s": (input_tokens + output_tokens) / elapsed_s}


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device | str, num_bytes: int | None = None,
                           iters: int | None = None) -> float:
    """Memory bandwidth from a device-to-device copy of a large buffer: bytes moved per second.

    Convention: a copy of N bytes reads N and writes N, so taking t seconds it scores
    2N / t (bytes read + bytes written), the usual way copy bandwidth is quoted and the rate
    at which a decode step can stream its weights. The buffer is 1 GiB on a GPU, 64 MiB on a
    CPU (unless `num_bytes`); the figure is over `iters` copies after two untimed ones.
    """
    import torch

    device = torch.device(device)
    gpu = device.type == "cuda"
    size = num_bytes or (_GPU_COPY_BYTES if gpu else _CPU_COPY_BYTES)
    count = iters or (20 if gpu else 5)
    src = torch.ones(size, dtype=torch.uint8, device=device)  # written, so its pages are real
    dst = torch.zeros_like(src)
    dst.copy_(src)
    dst.copy_(src)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(count):
        dst.copy_(src)
    synchronize(device)
    return 2 * size * count / (time.perf_counter() - started)


def gpu_driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None (said on stderr) when unreadable."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"meshserve bench: no driver version from nvidia-smi ({exc})", file=sys.stderr)
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0] if lines else None


def environment_info(device: torch.device) -> dict[str, Any]:
    """Versions and hardware the run used."""
    import torch

    installed = {(d.metadata["Name"] or "").lower(): d.version for d in metadata.distributions()}
    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "transformers": installed.get("transformers"),
        "meshserve": installed.get("meshserve"), "device": str(device),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info.update(gpu_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    driver=gpu_driver_version())
    return info


def model_info(model: torch.nn.Module, name: str, architecture: str) -> dict[str, Any]:
    """Name, dtype, parameter count and weight bytes (tied weights counted once)."""
    params = list(model.parameters())
    return {"name": name, "architecture": architecture, "dtype": str(params[0].dtype),
            "num_params": sum(p.numel() for p in params),
            "weight_bytes": sum(p.numel() * p.element_size() for p in params)}


def decode_read_bytes(model: torch.nn.Module, top_k: int) -> int:
    """The parameter bytes one decode token reads: all of them (as model_info's
    weight_bytes), except that of each mixture-of-experts layer's routed experts (stacked
    [E, ...] tensors) only top_k of E are read."""
    from meshserve.services.worker.models.moe import Experts  # torch: not at module import

    total = sum(p.numel() * p.element_size() for p in model.parameters())  # as weight_bytes
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        num_experts = experts.w13.shape[0]
        held = sum(p.numel() * p.element_size() for p in (experts.w13, experts.w2))
        total -= held - held * min(top_k, num_experts) // num_experts
    return total


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """The KV cache the engine sized, whether its loop overlaps steps, and the decode CUDA
    graphs it captured (None on CPU or with --enforce-eager): buckets, capture seconds and
    memory."""
    graphs = engine.graph_report
    return {"kv_cache_blocks": engine.num_kv_blocks, "block_size": engine.block_size,
            "async_scheduling": engine.async_scheduling, "max_num_seqs": engine.max_num_seqs,
            "tensor_parallel_size": engine.parallel.world_size,
            "expert_parallel": engine.parallel.expert_parallel,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "cuda_graphs": dataclasses.asdict(graphs) if graphs is not None else None,
            "piecewise_cuda_graphs": (dataclasses.asdict(engine.piecewise_report)
                                      if engine.piecewise_report is not None else None)}


def save_prompts(path: Path | None, prompts: Sequence[Sequence[int]],
                 output_lens: Sequence[int]) -> None:
    """`--save-prompts`: one JSON line per prompt, in run order, under the keys of vLLM's
    TokensPrompt (`prompt_token_ids`) and of its custom dataset (`output_tokens`)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for prompt, output_len in zip(prompts, output_lens, strict=True):
            out.write(json.dumps({"prompt_token_ids": list(prompt),
                                  "output_tokens": output_len}, separators=(",", ":")) + "\n")


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


def progress_bar(total: int, enabled: bool, unit: str) -> tqdm:
    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit=unit, dynamic_ncols=True)


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str
              ) -> tuple[float, float]:
    """(ttft, e2e) seconds of one batch run alone; ttft: every sequence has its first token."""
    waiting_first = {f"{tag}-{i}" for i in range(len(prompts))}
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    ttft: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                waiting_first.discard(out.request_id)
        if ttft is None and not waiting_first:
            ttft = time.perf_counter() - started
    # No device sync needed: a step returns once its sampled ids are on the host.
    assert ttft is not None, "a batch finished without producing a first token"
    return ttft, time.perf_counter() - started


def bench_latency(engine: LLMEngine, config: LatencyConfig) -> dict[str, Any]:
    """Warm-up, then `num_iters` timed batches; the latency JSON's figures."""
    runs, size = config.num_iters_warmup + config.num_iters, config.batch_size
    prompts = random_prompts([config.input_len] * (runs * size), engine.model_config,
                             config.seed)
    save_prompts(config.save_prompts, prompts, [config.output_len] * len(prompts))
    ttfts, e2es = [], []
    with progress_bar(runs, config.progress, "batch") as bar:
        for run in range(runs):
            ttft, e2e = run_batch(engine, prompts[run * size : (run + 1) * size],
                                  config.output_len, f"lat{run}")
            if run >= config.num_iters_warmup:
                ttfts.append(ttft)
                e2es.append(e2e)
            bar.update(1)
    return latency_report(e2es, ttfts, input_len=config.input_len, output_len=config.output_len,
                          batch_size=size, model_config=engine.model_config,
                          weight_bytes=model_info(engine.model, "", "")["weight_bytes"],
                          copy_bandwidth=measure_copy_bandwidth(engine.device),
                          read_bytes=decode_read_bytes(
                              engine.model, engine.model_config.num_experts_per_tok))


def bench_throughput(engine: LLMEngine, config: ThroughputConfig) -> dict[str, Any]:
    """Warm-up batches, then every request at once; the throughput JSON's figures."""
    all_lengths = config.lengths(engine.max_model_len)
    prompts = random_prompts([i for i, _ in all_lengths], engine.model_config, config.seed)
    share = slice(config.shard_index, None, config.num_shards)
    lengths, prompts = all_lengths[share], prompts[share]
    save_prompts(config.save_prompts, prompts, [o for _, o in lengths])
    # Warm-up prompts (short outputs) come from another seed, so that they leave nothing of
    # the timed prompts in the prefix cache. Lengths cycle through the timed ones.
    warm_lengths = [all_lengths[i % len(all_lengths)][0] for i in range(config.warmup_prompts)]
    warm = random_prompts(warm_lengths, engine.model_config, config.seed + 1)
    for run in range(config.num_iters_warmup):
        run_batch(engine, warm, min(_WARMUP_OUTPUT_LEN, all_lengths[0][1]), f"warm{run}")
    sequences: list[SequenceState] = []
    times = TokenTimes()
    if config.step_trace:
        engine.time_device()
    started = time.perf_counter()
    for i, (prompt, (_, output_len)) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"tput-{i}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        sequences.extend(engine.sequences(f"tput-{i}"))
    steps, step_s = 0, 0.0
    trace: list[StepRecord] = []
    with progress_bar(len(prompts), config.progress, "req") as bar:
        while engine.has_unfinished_requests():
            before = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter() - started
            steps += 1
            step_s += now + started - before
            if config.step_trace:
                load = engine.load()
                trace.append(StepRecord(
                    now + started, now + started - before, load.num_running,
                    load.num_waiting, len(prompts) if steps == 1 else 0, len(outputs),
                    sum(len(out.new_token_ids) for out in outputs), **device_fields(engine)))
            for out in outputs:
                times.add(out.request_id, len(out.new_token_ids), out.finished, now)
                bar.update(int(out.finished))
    if config.step_trace:
        write_step_trace(config.step_trace, trace)
    report = throughput_report(len(prompts), sum(i for i, _ in lengths),
                               sum(times.tokens.values()), time.perf_counter() - started)
    report.update(num_preemptions=sum(seq.num_preemptions for seq in sequences),
                  mean_input_len=report["input_tokens"] / len(prompts),
                  mean_output_len=sum(o for _, o in lengths) / len(prompts),
                  num_steps=steps, mean_step_ms=1e3 * step_s / max(steps, 1),
                  **times.latency_fields())
    return report


@dataclasses.dataclass
class TokenTimes:
    """When each request of a timed run got its tokens, in seconds since the run started.

    TTFT: the first delivery; ITL: the gap between a request's successive deliveries, split
    evenly over the tokens of a delivery that brings several; e2e: when it finished. Reported
    under the names `meshserve bench serve` uses (`mean_ttft_ms`, `p99_itl_ms`, ...).
    """

    ttft: dict[str, float] = dataclasses.field(default_factory=dict)
    last: dict[str, float] = dataclasses.field(default_factory=dict)
    itl: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    e2e: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, request_id: str, count: int, finished: bool, now: float) -> None:
        """`count` new tokens of `request_id` delivered at `now`."""
        if count:
            previous = self.last.get(request_id)
            if previous is None:
                self.ttft[request_id] = now
            else:
                self.itl.setdefault(request_id, []).extend([(now - previous) / count] * count)
            self.last[request_id] = now
            self.tokens[request_id] = self.tokens.get(request_id, 0) + count
        if finished:
            self.e2e[request_id] = now

    def latency_fields(self) -> dict[str, float]:
        """ttft/tpot/itl/e2el mean, median, std, p90, p99 in ms over the finished requests."""
        done = [r for r in self.e2e if r in self.ttft]
        tpots = [metrics.request_tpot(self.e2e[r], self.ttft[r], self.tokens[r])
                 for r in done if self.tokens[r] > 1]
        return metrics.latency_fields([self.ttft[r] for r in done], tpots,
                                      (gap for r in done for gap in self.itl.get(r, ())),
                                      [self.e2e[r] for r in done])


def summary(kind: str, r: dict[str, Any]) -> str:
    """A few human lines of a latency or throughput result."""
    if kind == "throughput":
        # The transformers peer (loadtest/hf_peer_bench.py) has no per-request latencies.
        latencies = "" if "mean_ttft_ms" not in r else "\n" + ", ".join(
            f"{name} mean {r[f'mean_{name}_ms']:.2f} ms p99 {r[f'p99_{name}_ms']:.2f} ms"
            for name in metrics.METRICS)
        return (f"throughput: {r['num_requests']} requests in {r['elapsed_s']:.2f}s: "
                f"{r['requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:.1f} output "
                f"tokens/s, {r['total_tokens_per_s']:.1f} total tokens/s, "
                f"{r['num_preemptions']} preemptions{latencies}")
    lines = [f"{key[:-2]}: " + ", ".join(f"{q} {v * 1e3:.3f} ms" for q, v in r[key].items())
             for key in ("latency_s", "ttft_s", "tpot_s") if r[key] is not None]
    ratio = "" if r["tpot_over_floor"] is None else f"; tpot = {r['tpot_over_floor']:.2f}x floor"
    return "\n".join(lines) + (
        f"\nfloor: {r.get('read_bytes', r['weight_bytes']) / 1e9:.3f} GB a decode token "
        f"reads (of {r['weight_bytes'] / 1e9:.3f} GB of weights) / "
        f"{r['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s copied = "
        f"{r['floor_s_per_token'] * 1e3:.3f} ms per token{ratio}\n"
        f"prefill: {r['prefill']['flops_per_s'] / 1e12:.3g} TFLOP/s")


def main(argv: Sequence[str]) -> int:
    """`meshserve bench latency|throughput|serve ...`; returns the exit code."""
    args = list(argv)
    if args and args[0] == "serve":
        from meshserve.bench.serve.cli import main as serve_main

        return serve_main(args[1:])
    if not args or args[0] not in ("latency", "throughput"):
        asked = bool(args) and args[0] in ("-h", "--help")
        print(_USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    kind = args[0]
    config_class = LatencyConfig if kind == "latency" else ThroughputConfig
    try:
        config = config_class.from_args(short_flags(args[1:]), strict_env=False,
                                        prog=f"meshserve bench {kind}")
    except ConfigError as exc:
        print(f"meshserve bench {kind}: {exc.message}", file=sys.stderr)
        return 2
    import torch

    from meshserve.services.worker.builder import build_engine
    from meshserve.services.worker.heap import settled_heap

    try:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        engine = build_engine(config)
        with settled_heap(engine):
            figures = (bench_latency(engine, config) if isinstance(config, LatencyConfig)
                       else bench_throughput(engine, config))  # type: ignore[arg-type]
    except MeshError as exc:
        print(f"meshserve bench {kind}: {exc.message}", file=sys.stderr)
        return 1
    result = {"benchmark": kind, "backend": "meshserve", "config": config.as_dict(),
              "environment": {**environment_info(engine.device), "engine": engine_info(engine)},
              "model": model_info(engine.model, engine.source.name,
                                  engine.model_config.architecture), **figures}
    print(summary(kind, result))
    write_json(config.output_json, result)
    engine.close()  # its tensor-parallel ranks, if any
    return 0
