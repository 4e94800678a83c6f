"""vLLM's offline engine on the token prompts `meshserve bench` ran, and the two side by side.

`vllm.LLM` is the peer of DESIGN.md's speed budgets, measured on the same GPU in the same call.

Driver part: `vllm` (loadtest/gpu/vllm.sh installs vLLM from the parts loadtest/vllm_fetch.sh
prepares, runs `meshserve bench` with `--save-prompts`, then this script on those files).

    python loadtest/vllm_offline.py check          # vLLM's offline path imports
    python loadtest/vllm_offline.py run --model DIR --throughput-prompts sharegpt.jsonl \
        --latency-prompts latency.jsonl --latency-warmup 2 --max-model-len 8448 \
        --gpu-memory-utilization 0.9 --output-json vllm.json
    python loadtest/vllm_offline.py report --vllm vllm.json --meshserve-throughput \
        sharegpt.json --meshserve-latency latency.json --out-json summary.json --out-md summary.md

A prompt file is what `meshserve bench throughput|latency --save-prompts` writes: one JSON line
per request, {"prompt_token_ids": [...], "output_tokens": N}. `run` starts one `LLM` with dummy
weights and no tokenizer (`load_format="dummy"`, `skip_tokenizer_init=True`), FlashAttention
(`--attention-backend`), then every keyword of `--llm-kwargs` JSON (e.g. tensor_parallel_size),
timing its start, then:
- throughput: `--num-iters-warmup` untimed batches of `--warmup-prompts` prompts (timed prompts
  reversed, so they share no prefix-cache block with them; at most 16 output tokens each, as
  meshserve's warm-up), then every prompt in one `LLM.generate` call, greedy, ignore_eos, each
  its own max_tokens, timed around the call as `vllm bench throughput` times it;
- latency: the file's prompts one at a time, the first `--latency-warmup` untimed, each run
  twice: to its full output (e2e) and, reversed, to one token (TTFT: the prefill and one
  sample); TPOT = (e2e - TTFT) / (output - 1), as `meshserve bench latency` defines it.
The JSON keys are those of `meshserve bench` (output_tokens_per_s, tpot_s, ...). vLLM is
imported by `run` and `check` only, after its environment defaults are set (FlashInfer's
sampler off, no usage reporting, offline); `--help` and `report` import none of it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

# Set before vLLM is imported, unless the caller set them: no FlashInfer sampler (FlashInfer
# is not installed), no usage report, nothing fetched from a hub.
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Output tokens of each warm-up request, as `meshserve bench throughput` warms up.
WARMUP_OUTPUT_LEN = 16


# What `LLM(...)` imports on its offline path (dummy weights, Llama and Qwen3-MoE), its
# compiled ops included: a missing dependency shows in seconds, not minutes into a run.
CHECK_MODULES = ("vllm._C", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
                 "vllm.v1.engine.core", "vllm.v1.engine.core_client",
                 "vllm.v1.executor.multiproc_executor", "vllm.v1.executor.uniproc_executor",
                 "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
                 "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler",
                 "vllm.model_executor.model_loader.dummy_loader",
                 "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3_moe")


@dataclass(frozen=True)
class Request:
    """One line of a prompt file."""

    prompt: list[int]
    output_len: int


def read_prompts(path: Path) -> list[Request]:
    """The requests of a `--save-prompts` file, in order; ValueError naming the line when one
    is not {"prompt_token_ids": [int, ...], "output_tokens": int >= 1}."""
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        entry = json.loads(line)
        ids = entry.get("prompt_token_ids") if isinstance(entry, dict) else None
        out = entry.get("output_tokens") if isinstance(entry, dict) else None
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)
                and isinstance(out, int) and out >= 1):
            raise ValueError(f"{path}:{number}: expected {{\"prompt_token_ids\": [int, ...], "
                             f"\"output_tokens\": int >= 1}}, got {line[:80]}")
        requests.append(Request(ids, out))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def summarize(values: Sequence[float]) -> dict[str, float]:
    """avg, p50, p90, p99 (numpy.percentile, linear), as `meshserve bench` summarizes."""
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), (50, 90, 99)).tolist()
    return {"avg": float(np.mean(values)), "p50": p50, "p90": p90, "p99": p99}


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keywords: the benchmark's fixed ones, then `--llm-kwargs` over them."""
    kwargs: dict[str, Any] = {
        "model": str(args.model), "load_format": "dummy", "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": args.seed}
    if args.attention_backend != "auto":
        kwargs["attention_config"] = {"backend": args.attention_backend}
    extra = json.loads(args.llm_kwargs)
    if not isinstance(extra, dict):
        raise TypeError(f"--llm-kwargs must be a JSON object, got {args.llm_kwargs}")
    return {**kwargs, **extra}


class VllmBench:
    """One `vllm.LLM`, run through the throughput and latency workloads."""

    def __init__(self, vllm: ModuleType, kwargs: dict[str, Any]) -> None:
        self.vllm = vllm
        started = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        self.startup_s = time.perf_counter() - started

    def generate(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int]
                 ) -> tuple[float, list[int]]:
        """(seconds, generated token counts) of one `LLM.generate` call, greedy, ignore_eos."""
        inputs = [self.vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        params = [self.vllm.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n,
                                           detokenize=False) for n in output_lens]
        started = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return seconds, [len(out.outputs[0].token_ids) for out in outputs]

    def throughput(self, requests: list[Request], warmups: int, warmup_prompts: int
                   ) -> dict[str, Any]:
        """Warm-up batches, then every request in one call; `meshserve bench throughput`'s
        figures."""
        warm = [requests[i % len(requests)].prompt[::-1] for i in range(warmup_prompts)]
        for _ in range(warmups):
            self.generate(warm, [min(WARMUP_OUTPUT_LEN, requests[0].output_len)] * len(warm))
        wanted = [r.output_len for r in requests]
        elapsed, generated = self.generate([r.prompt for r in requests], wanted)
        inputs, outputs = sum(len(r.prompt) for r in requests), sum(generated)
        return {"num_requests": len(requests), "input_tokens": inputs, "output_tokens": outputs,
                "elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
                "output_tokens_per_s": outputs / elapsed,
                "total_tokens_per_s": (inputs + outputs) / elapsed,
                "mean_input_len": inputs / len(requests),
                "mean_output_len": sum(wanted) / len(requests),
                "short_outputs": sum(g < w for g, w in zip(generated, wanted, strict=True))}

    def latency(self, requests: list[Request], warmups: int) -> dict[str, Any]:
        """Each request alone, to its full output and (reversed) to one token; the first
        `warmups` untimed. `meshserve bench latency`'s e2e, TTFT and TPOT."""
        if len(requests) <= warmups:
            raise ValueError(f"{len(requests)} latency prompts leave none after {warmups} "
                             f"warm-up runs")
        e2es, ttfts = [], []
        for i, request in enumerate(requests):
            e2e, generated = self.generate([request.prompt], [request.output_len])
            ttft, _ = self.generate([request.prompt[::-1]], [1])
            assert generated == [request.output_len], \
                f"asked for {request.output_len} tokens, got {generated}"
            if i >= warmups:
                e2es.append(e2e)
                ttfts.append(ttft)
        output_len = requests[0].output_len
        tpot = None if output_len == 1 else summarize(
            [(e - t) / (output_len - 1) for e, t in zip(e2es, ttfts, strict=True)])
        return {"input_len": len(requests[0].prompt), "output_len": output_len,
                "batch_size": 1, "num_iters": len(e2es), "latencies_s": e2es, "ttfts_s": ttfts,
                "latency_s": summarize(e2es), "ttft_s": summarize(ttfts), "tpot_s": tpot,
                "ttft_method": "e2e of the prompt reversed, asked for one token"}

    def engine_facts(self) -> dict[str, Any]:
        """What vLLM chose: KV blocks, batch limits, dtype, prefix caching, attention."""
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        paths = {"num_gpu_blocks": "cache_config.num_gpu_blocks",
                 "block_size": "cache_config.block_size",
                 "enable_prefix_caching": "cache_config.enable_prefix_caching",
                 "max_num_seqs": "scheduler_config.max_num_seqs",
                 "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
                 "dtype": "model_config.dtype", "max_model_len": "model_config.max_model_len",
                 "attention_backend": "attention_config.backend",
                 "tensor_parallel_size": "parallel_config.tensor_parallel_size"}
        facts = {}
        for name, path in paths.items():
            value: Any = config
            for attr in path.split("."):
                value = getattr(value, attr, None)
            facts[name] = value if value is None or isinstance(value, (int, float, bool)) \
                else str(value)
        return facts


def environment(vllm: ModuleType) -> dict[str, Any]:
    """vLLM, torch and Python versions and the GPU (asked after the runs: no CUDA context in
    this process before vLLM's)."""
    import torch

    info: dict[str, Any] = {"vllm": getattr(vllm, "__version__", None), "torch": torch.__version__,
                            "python": platform.python_version(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def set_vllm_env() -> None:
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)


def check(args: argparse.Namespace) -> int:
    """`check`: import each of `--modules`; say where vLLM and torch come from; 1 if any
    import fails (each failure printed)."""
    set_vllm_env()
    failed = []
    for name in args.modules.split(","):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (every failure is printed and counted)
            failed.append(name)
            print(f"vllm_offline check: import {name}: {type(exc).__name__}: {exc}")
    import torch

    vllm = importlib.import_module("vllm")
    print(f"vllm {getattr(vllm, '__version__', '?')} from {vllm.__file__}; torch "
          f"{torch.__version__} from {torch.__file__}; {len(failed)} of "
          f"{len(args.modules.split(','))} modules failed to import")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """`run`: start vLLM, run the workloads whose prompt files are given, write the JSON."""
    set_vllm_env()
    kwargs = llm_kwargs(args)
    tput = read_prompts(args.throughput_prompts) if args.throughput_prompts else None
    lat = read_prompts(args.latency_prompts) if args.latency_prompts else None
    vllm = importlib.import_module("vllm")
    bench = VllmBench(vllm, kwargs)
    print(f"vllm_offline: LLM started in {bench.startup_s:.1f}s", flush=True)
    result: dict[str, Any] = {"backend": "vllm", "llm_kwargs": kwargs,
                              "startup_s": bench.startup_s, "engine": bench.engine_facts()}
    # Written after each workload: a run cut short by its time limit keeps what it measured.
    if tput is not None:
        result["throughput"] = bench.throughput(tput, args.num_iters_warmup, args.warmup_prompts)
        result["throughput"]["prompts_sha256"] = file_sha256(args.throughput_prompts)
        print(f"vllm_offline: throughput {json.dumps(result['throughput'])}", flush=True)
        write_json(args.output_json, result)
    if lat is not None:
        result["latency"] = bench.latency(lat, args.latency_warmup)
        result["latency"]["prompts_sha256"] = file_sha256(args.latency_prompts)
        print(f"vllm_offline: latency {json.dumps(result['latency']['tpot_s'])}", flush=True)
    result["environment"] = environment(vllm)
    write_json(args.output_json, result)
    return 0


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def _load(path: Path | None) -> dict[str, Any] | None:
    """A JSON result, or None (said on stderr) where its step wrote none."""
    if path is None or not path.is_file():
        print(f"vllm_offline report: no {path}", file=sys.stderr)
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


# (section, label, key path in either JSON, scale, unit, budget): the rows of the table.
ROWS = [("throughput", "output tokens/s", "output_tokens_per_s", 1.0, "", ">= 1.3"),
        ("throughput", "requests/s", "requests_per_s", 1.0, "", ""),
        ("throughput", "total tokens/s", "total_tokens_per_s", 1.0, "", ""),
        ("throughput", "elapsed", "elapsed_s", 1.0, "s", ""),
        ("latency", "TPOT (avg)", "tpot_s.avg", 1e3, "ms", "<= 0.9"),
        ("latency", "TPOT (median)", "tpot_s.p50", 1e3, "ms", ""),
        ("latency", "TTFT (avg; vLLM: a one-token request)", "ttft_s.avg", 1e3, "ms", ""),
        ("latency", "e2e (avg)", "latency_s.avg", 1e3, "ms", "")]


def _at(result: dict[str, Any] | None, path: str) -> float | None:
    value: Any = result
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _cell(value: float | None, scale: float, unit: str) -> str:
    return "-" if value is None else f"{value * scale:,.2f} {unit}".strip()


def side_by_side(vllm_path: Path, tput_path: Path | None, lat_path: Path | None
                 ) -> tuple[dict[str, Any], str]:
    """(summary JSON, markdown table) of vLLM's `run` result against `meshserve bench`'s
    throughput and latency results; ratios are meshserve / vLLM."""
    peer = _load(vllm_path) or {}
    ours = {"throughput": _load(tput_path), "latency": _load(lat_path)}
    rows, table = [], ["| figure | vLLM | meshserve | meshserve / vLLM | DESIGN.md budget |",
                       "|---|---|---|---|---|"]
    for section, label, path, scale, unit, budget in ROWS:
        theirs, mine = _at(peer.get(section), path), _at(ours[section], path)
        ratio = mine / theirs if mine is not None and theirs else None
        rows.append({"section": section, "figure": label, "vllm": theirs, "meshserve": mine,
                     "ratio": ratio})
        table.append(f"| {label} | {_cell(theirs, scale, unit)} | {_cell(mine, scale, unit)} "
                     f"| {'-' if ratio is None else f'{ratio:.3f}'} | {budget} |")
    env, tput = peer.get("environment", {}), peer.get("throughput") or {}
    same = {key: tput.get(key) == (ours["throughput"] or {}).get(key)
            for key in ("num_requests", "input_tokens", "output_tokens")}
    startup = peer.get("startup_s")
    summary = {"gpu": env.get("gpu_name"), "vllm": env.get("vllm"), "torch": env.get("torch"),
               "model": (peer.get("llm_kwargs") or {}).get("model"), "vllm_startup_s": startup,
               "vllm_engine": peer.get("engine"), "prompts_sha256": tput.get("prompts_sha256"),
               "same_workload": same, "rows": rows}
    started = "?" if startup is None else f"{startup:.1f}"
    workload = "yes" if all(same.values()) else f"NO {same}"
    lat = peer.get("latency") or {}
    table += ["", (f"Throughput: {tput.get('num_requests', '?')} requests at once, "
                   f"{tput.get('input_tokens', '?')} prompt and {tput.get('output_tokens', '?')} "
                   f"output tokens; latency: one request of {lat.get('input_len', '?')} in / "
                   f"{lat.get('output_len', '?')} out at a time, {lat.get('num_iters', '?')} "
                   "timed."),
              "", (f"GPU {env.get('gpu_name', '?')}; vLLM {env.get('vllm', '?')}, torch "
                   f"{env.get('torch', '?')}; model {summary['model']}; vLLM started in "
                   f"{started} s. Same requests, input and output tokens: {workload} (prompts "
                   f"sha256 {str(tput.get('prompts_sha256'))[:12]}).")]
    return summary, "\n".join(table)


def report(args: argparse.Namespace) -> int:
    """`report`: the figures of both engines side by side, as JSON and markdown."""
    summary, table = side_by_side(args.vllm, args.meshserve_throughput, args.meshserve_latency)
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.out_md is not None:
        args.out_md.write_text(table + "\n")
    print(table)
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="vLLM on the prompt files; writes --output-json")
    r.add_argument("--model", type=Path, required=True, help="model folder (config.json)")
    r.add_argument("--throughput-prompts", type=Path, default=None,
                   help="`meshserve bench throughput --save-prompts` file")
    r.add_argument("--latency-prompts", type=Path, default=None,
                   help="`meshserve bench latency --save-prompts` file")
    r.add_argument("--latency-warmup", type=int, default=2,
                   help="untimed latency prompts at the file's start (its --num-iters-warmup)")
    r.add_argument("--num-iters-warmup", type=int, default=1, help="throughput warm-up batches")
    r.add_argument("--warmup-prompts", type=int, default=8, help="prompts of a warm-up batch")
    r.add_argument("--max-model-len", type=int, default=None)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="as meshserve's default (vLLM's LLM defaults to 0.92)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--attention-backend", default="FLASH_ATTN",
                   help="vLLM's attention_config backend; auto: vLLM chooses")
    r.add_argument("--llm-kwargs", default="{}",
                   help="JSON object of more LLM(...) keywords, over the fixed ones")
    r.add_argument("--output-json", type=Path, default=None)
    c = sub.add_parser("check", help="the modules of vLLM's offline path import")
    c.add_argument("--modules", default=",".join(CHECK_MODULES),
                   help="comma-separated modules to import")
    p = sub.add_parser("report", help="both engines side by side")
    p.add_argument("--vllm", type=Path, required=True, help="`run`'s JSON")
    p.add_argument("--meshserve-throughput", type=Path, default=None,
                   help="`meshserve bench throughput --output-json` on the same prompts")
    p.add_argument("--meshserve-latency", type=Path, default=None,
                   help="`meshserve bench latency --output-json` on the same prompts")
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--out-md", type=Path, default=None)
    args = parser.parse_args(list(argv))
    if args.command == "run" and not (args.throughput_prompts or args.latency_prompts):
        parser.error("give --throughput-prompts, --latency-prompts or both")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    commands = {"run": run, "check": check, "report": report}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
