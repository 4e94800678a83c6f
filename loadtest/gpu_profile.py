"""Where a step's time goes on the GPU: kernel breakdowns and a step timeline.

Driver part: `profile`.

For the Llama-3.1-8B-shaped model of the GPU suite (dummy weights), prints:
- single-stream decode: device time per step (CUDA graphs) against the step's wall time,
  and the kernels of one eager decode step, by total time;
- batch-1 decode's host time per step by phase (scheduling, inputs, replay, sampler, wait);
- the prefill of one 8k-token prompt (eager): its kernels by total time;
- the ShareGPT-like workload: wall time split between decode-only and mixed steps, their
  token counts, and the kernels of a window of steps of each kind.

    python loadtest/gpu_profile.py --model <folder> [--num-prompts 1000] --out $OUT/profile \
        [--parts single,host,prefill,sharegpt]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from meshserve.bench.engine import random_prompts, sharegpt_like_lengths
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.sampling_params import SamplingParams


def kernel_table(prof: profile, steps: int, limit: int = 25) -> tuple[str, float]:
    """Top kernels by device time (per step), and the device time per step in ms."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0
              and e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / steps / 1e3
    lines = [f"{'kernel':90s} {'calls/step':>10s} {'ms/step':>9s} {'share':>6s}"]
    for e in events[:limit]:
        per = e.device_time_total / steps / 1e3
        lines.append(f"{e.key[:90]:90s} {e.count / steps:10.1f} {per:9.3f} "
                     f"{100 * per / total:5.1f}%")
    return "\n".join(lines), total


# EngineConfig fields every engine of a run takes (--engine, e.g. {"quantization": "fp8"}).
ENGINE_OVERRIDES: dict[str, Any] = {}


def engine_for(model: str, **overrides: Any) -> LLMEngine:
    config = {"model": model, "load_format": "dummy", "max_model_len": 2048,
              **ENGINE_OVERRIDES}
    config.update(overrides)
    return build_engine(EngineConfig(**config))


def single_stream(model: str, report: dict[str, Any], text: list[str],
                  modes: tuple[bool, ...] = (False, True)) -> None:
    for eager in modes:
        engine = engine_for(model, max_num_seqs=1, enforce_eager=eager)
        prompt = random_prompts([128], engine.model_config, 0)[0]
        engine.add_request("warm", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("p", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(20):
            engine.step()
        steps = 40
        torch.cuda.synchronize()
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / steps * 1e3
        table, device = kernel_table(prof, steps)
        name = "eager" if eager else "graphs"
        report[f"decode_b1_{name}"] = {"wall_ms_per_step_profiled": wall,
                                       "device_ms_per_step": device}
        text.append(f"== batch-1 decode, {name}: device {device:.3f} ms/step, wall "
                    f"{wall:.3f} ms/step (under the profiler)\n{table}\n")
        # Unprofiled wall time per step.
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        report[f"decode_b1_{name}"]["wall_ms_per_step"] = (
            (time.perf_counter() - started) / steps * 1e3)
        text.append(f"   unprofiled wall {report[f'decode_b1_{name}']['wall_ms_per_step']:.3f}"
                    f" ms/step\n")
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def host_phases(model: str, report: dict[str, Any], text: list[str]) -> None:
    """Host time per batch-1 decode step (graphs, overlapped loop) by phase, unprofiled: if the
    phases other than the wait add up to the device's step time, the host sets the pace."""
    from meshserve.services.worker.engine import model_runner

    engine = engine_for(model, max_num_seqs=1)
    prompt = random_prompts([128], engine.model_config, 0)[0]
    engine.add_request("p", prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(30):
        engine.step()
    spent: dict[str, float] = defaultdict(float)

    def timed(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - began
        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "prepare", "launch: prepare inputs")
    timed(engine.runner, "forward", "launch: graph replay")
    timed(engine.runner.sampler, "sample_async", "launch: sampler")
    timed(engine.runner, "launch", "launch (all)")
    class_result = model_runner.LaunchedStep.result
    timed(model_runner.LaunchedStep, "result", "wait + read tokens")
    timed(engine, "_apply", "apply outputs (incl. wait)")
    steps = 200
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps * 1e6
    model_runner.LaunchedStep.result = class_result  # type: ignore[method-assign]
    phases = {label: seconds / steps * 1e6 for label, seconds in spent.items()}
    report["host_phases_b1"] = {"wall_us_per_step": wall, "phases_us_per_step": phases}
    lines = [f"== batch-1 decode host phases (graphs, overlapped): wall {wall:.0f} us/step"]
    lines += [f"   {label:32s} {us:8.0f} us/step" for label, us in phases.items()]
    text.append("\n".join(lines) + "\n")
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def prefill(model: str, report: dict[str, Any], text: list[str], length: int = 8192) -> None:
    """The kernels of one eager step prefilling a `length`-token prompt."""
    engine = engine_for(model, max_num_seqs=1, enforce_eager=True, max_model_len=length + 256,
                        max_num_batched_tokens=length)
    prompts = random_prompts([length] * 3, engine.model_config, 0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(prompts[:2]):  # warm-up, and no prefix-cache hit after it
        engine.add_request(f"warm{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request("p", prompts[2], params)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - started) * 1e3
    table, device = kernel_table(prof, 1, limit=30)
    report["prefill"] = {"tokens": length, "device_ms": device, "wall_ms_profiled": wall}
    text.append(f"== prefill of {length} tokens, eager: device {device:.3f} ms, wall "
                f"{wall:.3f} ms (under the profiler)\n{table}\n")
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


# ProfilerActivity.CPU when --host-windows asks for the host side of the ShareGPT-like windows.
HOST_ACTIVITY: list[ProfilerActivity] = []


def sharegpt(model: str, num_prompts: int, flags: dict[str, Any], report: dict[str, Any],
             text: list[str], windows: tuple[int, ...] = (60, 400)) -> None:
    engine = engine_for(model, **flags)
    lengths = sharegpt_like_lengths(num_prompts, 0, engine.max_model_len)
    prompts = random_prompts([i for i, _ in lengths], engine.model_config, 0)
    warm = random_prompts([64] * 8, engine.model_config, 1)
    for i, p in enumerate(warm):
        engine.add_request(f"w{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for i, (p, (_, out)) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=out, ignore_eos=True))
    kinds: dict[str, list[float]] = defaultdict(list)
    tokens: dict[str, int] = defaultdict(int)
    seqs: dict[str, int] = defaultdict(int)
    launch = engine.runner.launch
    current: dict[str, Any] = {}

    def spy(out, previous=None):  # type: ignore[no-untyped-def]
        decode = all(s.num_new_tokens == 1 for s in out.scheduled)
        current["kind"] = "decode" if decode else "mixed"
        current["tokens"] = out.num_tokens
        current["seqs"] = len(out.scheduled)
        return launch(out, previous)

    engine.runner.launch = spy  # type: ignore[method-assign]
    profiled: dict[str, str] = {}
    started = time.perf_counter()
    step_count = 0
    while engine.has_unfinished_requests():
        current.clear()
        t0 = time.perf_counter()
        kind_before = None
        window = None
        if step_count in windows and profiled.get(str(step_count)) is None:
            window = profile(activities=[ProfilerActivity.CUDA, *HOST_ACTIVITY])
            window.__enter__()
        engine.step()
        if window is not None:
            for _ in range(9):
                engine.step()
            torch.cuda.synchronize()
            window.__exit__(None, None, None)
            table, device = kernel_table(window, 10, limit=20)
            profiled[str(step_count)] = (f"== ShareGPT-like steps {step_count}..+10 (last "
                                         f"kind {current.get('kind')}, {current.get('seqs')} "
                                         f"seqs, {current.get('tokens')} tokens): device "
                                         f"{device:.3f} ms/step\n{table}\n")
            if HOST_ACTIVITY:  # where the host's time went: runtime calls and ops, by self
                profiled[str(step_count)] += "host, by self time over the 10 steps:\n" + \
                    window.key_averages().table(sort_by="self_cpu_time_total",
                                                row_limit=25, max_name_column_width=60) + "\n"
            step_count += 10
            continue
        kind_before = current.get("kind", "none")
        kinds[kind_before].append(time.perf_counter() - t0)
        tokens[kind_before] += current.get("tokens", 0)
        seqs[kind_before] += current.get("seqs", 0)
        step_count += 1
    elapsed = time.perf_counter() - started
    produced = sum(o for _, o in lengths)
    summary = {k: {"steps": len(v), "seconds": sum(v), "ms_per_step": 1e3 * sum(v) / len(v),
                   "tokens_per_step": tokens[k] / len(v), "seqs_per_step": seqs[k] / len(v)}
               for k, v in kinds.items()}
    key = f"sharegpt_{'_'.join(f'{k}{v}' for k, v in flags.items()) or 'default'}"
    report[key] = {"elapsed_s": elapsed, "output_tok_s": produced / elapsed,
                   "steps": summary}
    text.append(f"== {key}: {produced / elapsed:.0f} output tok/s in {elapsed:.1f}s "
                f"(profiled windows included)")
    for k, v in summary.items():
        text.append(f"   {k:7s} {v['steps']:5d} steps, {v['seconds']:6.2f}s, "
                    f"{v['ms_per_step']:6.2f} ms/step, {v['tokens_per_step']:7.1f} tokens, "
                    f"{v['seqs_per_step']:6.1f} seqs per step")
    text.extend(profiled.values())
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="single,sharegpt",
                        help="of single, graphs (single without the eager run), host, "
                             "prefill, sharegpt")
    parser.add_argument("--windows", default="60,400",
                        help="ShareGPT-like steps at which a 10-step kernel window starts "
                             "(the first ~25 steps are the mixed prefill steps)")
    parser.add_argument("--host-windows", action="store_true",
                        help="the ShareGPT-like windows also record the host (CPU) side")
    parser.add_argument("--engine", type=json.loads, default={},
                        help='EngineConfig fields as JSON, e.g. {"tensor_parallel_size": 2}')
    args = parser.parse_args()
    ENGINE_OVERRIDES.update(args.engine)
    if args.host_windows:
        HOST_ACTIVITY.append(ProfilerActivity.CPU)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    text: list[str] = []
    parts = args.parts.split(",")
    if "single" in parts or "graphs" in parts:
        single_stream(args.model, report, text, (False, True) if "single" in parts else (False,))
        print("\n".join(text), flush=True)
    if "host" in parts:
        start = len(text)
        host_phases(args.model, report, text)
        print("\n".join(text[start:]), flush=True)
    if "prefill" in parts:
        start = len(text)
        prefill(args.model, report, text)
        print("\n".join(text[start:]), flush=True)
    if "sharegpt" in parts:
        start = len(text)
        sharegpt(args.model, args.num_prompts, {}, report, text,
                 tuple(int(w) for w in args.windows.split(",")))
        print("\n".join(text[start:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(report, indent=2))
    (args.out / "profile.txt").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
