"""KV-aware against round-robin routing on a prefix-heavy load, two workers, one JSON report.

Driver part: `kv` (KV_PARTS=routing).

    python loadtest/kv_routing.py --out report.json [--model PATH] [--num-prompts 200] \
        [--concurrency 16 | --request-rate 8] [--prefix-tenants 32 --prefix-len 2048 ...] \
        [-- LAUNCHER FLAGS]

For each routing policy of `--policies` (kv-aware, then round-robin) in turn, on a fresh
stack: `meshserve up` (`start_stack`) with `--workers` workers (2), the kvstore and
`--routing POLICY`, plus every flag after `--` as `meshserve up` takes it (engine flags reach
each worker: `--load-format dummy`, `--device cuda:0 --gpu-memory-utilization 0.42` for two
workers on one GPU, `--no-kvstore`, `--num-kv-blocks N`, ...). Then the serving benchmark's
own code (`build_workload`, `run_benchmark`) sends the same prefix-heavy requests (one seed:
the same token prompts in the same order) at `--concurrency` or `--request-rate`, greedy with
`ignore_eos`. A fresh stack per policy: both start with cold caches. A policy may carry
the kv-aware prefill weight as `kv-aware@W` (the scheduler's MESHSERVE_PREFILL_WEIGHT for
that run), so several weights run against one round-robin baseline.

The report holds each run's figures (the bench's result without its per-request arrays:
output tok/s, TTFT p50/p90/p99, cached prompt tokens and their fraction, ...), what each worker
finished (from its /metrics, warm-up included), the ratios (kv-aware over round-robin output
throughput; round-robin over kv-aware p90 TTFT), the command line and the versions (python,
torch, transformers, meshserve, the GPU's name if any).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Self

from prometheus_client.parser import text_string_to_metric_families

from meshserve.bench.serve.config import ServeConfig
from meshserve.bench.serve.datasets import facts_of
from meshserve.bench.serve.runner import run_benchmark
from meshserve.bench.serve.workload import Workload, build_workload
from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.shared.errors import ConfigError, MeshError
from meshserve.shared.model_config import read_model_files
from meshserve.shared.model_source import resolve_model

MODEL_NAME = "model"
POLICIES = ("kv-aware", "round-robin")
# Worker counters read after each run: requests finished (by reason) and tokens generated.
_WORKER_PREFIX = "meshserve:worker_"
_WORKER_COUNTERS = {"meshserve:worker_sequences_finished": "sequences_finished",
                    "meshserve:worker_generated_tokens": "generated_tokens"}


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The driver's own flags, and the launcher flags after `--`."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="model folder or .gguf file (default: SmolLM2-135M-Instruct); "
                             "random weights with `-- --load-format dummy`")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="routing policies to run, in order (default: kv-aware,round-robin)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16,
                        help="most requests in flight (0: no cap)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: all at once)")
    parser.add_argument("--prefix-tenants", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--prefix-zipf-s", type=float, default=1.1)
    parser.add_argument("--prefix-question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-warmup", type=int, default=2)
    parser.add_argument("--warm-requests", type=int, default=0,
                        help="K more prefix-heavy requests, drawn first and sent untimed "
                        "before the timed ones (the caches of a server that has been up), "
                        "at most --warm-concurrency at a time")
    parser.add_argument("--warm-concurrency", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="services' logs, one folder per policy (default: temporary)")
    parser.add_argument("--metrics-dir", type=Path, default=None,
                        help="write every service's /metrics text after each run here, "
                        "one folder per policy")
    parser.add_argument("--progress", action="store_true", help="a progress bar on stderr")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def split_policy(spec: str) -> tuple[str, dict[str, str]]:
    """`kv-aware@4` -> ("kv-aware", {"MESHSERVE_PREFILL_WEIGHT": "4"}); a bare name: no env."""
    policy, _, weight = spec.partition("@")
    if not weight:
        return policy, {}
    try:
        float(weight)
    except ValueError:
        raise ConfigError(f"the prefill weight of {spec!r} is not a number",
                          param="policies") from None
    return policy, {"MESHSERVE_PREFILL_WEIGHT": weight}


def launcher_config(args: argparse.Namespace, spec: str, extra: Sequence[str]
                    ) -> LauncherConfig:
    """`meshserve up --routing POLICY ...` for one run (flags after `--` last, so they win)."""
    flags = ["--workers", str(args.workers), "--port", "0", "--served-model-name", MODEL_NAME,
             "--routing", split_policy(spec)[0], "--startup-timeout-s", str(args.startup_timeout_s)]
    if args.model is not None:
        flags += ["--model", args.model]
    if args.run_dir is not None:
        flags += ["--run-dir", str(args.run_dir / spec)]
    return LauncherConfig.from_args([*flags, *extra], strict_env=False, prog="meshserve up")


def serve_config(args: argparse.Namespace, launcher: LauncherConfig) -> ServeConfig:
    """The bench's config: prefix-heavy token prompts over the model's vocabulary (its
    special ids left out), cut by the context the workers serve."""
    facts = facts_of(read_model_files(resolve_model(launcher.model, launcher.load_format)))
    max_model_len = min(facts.max_model_len, launcher.max_model_len or facts.max_model_len)
    return ServeConfig(
        model=MODEL_NAME, dataset="prefix-heavy", prompt_format="token-ids",
        vocab_size=facts.vocabulary.size, special_ids=tuple(sorted(facts.vocabulary.special_ids)),
        max_model_len=max_model_len, num_prompts=args.num_prompts + args.warm_requests,
        prefix_tenants=args.prefix_tenants, prefix_len=args.prefix_len,
        prefix_zipf_s=args.prefix_zipf_s, prefix_question_len=args.prefix_question_len,
        random_output_len=args.output_len, seed=args.seed, request_rate=args.request_rate,
        max_concurrency=args.concurrency or None, ignore_eos=True, temperature=0.0,
        num_warmup=args.num_warmup, timeout_s=args.timeout_s, progress=args.progress)


def split_warm(workload: Workload, count: int) -> tuple[Workload, Workload | None]:
    """(the timed run: all but the first `count` requests; the warm pass: those, or None)."""
    if count <= 0:
        return workload, None
    return (dataclasses.replace(workload, requests=workload.requests[count:]),
            Workload(workload.requests[:count], [], workload.vocabulary))


def worker_counters(stack: Stack, dump_dir: Path | None = None
                    ) -> dict[str, dict[str, float]]:
    """Per worker: every counter of its /metrics (requests finished, tokens generated, the
    kvstore's saves, probes and loads...), summed over labels; with `dump_dir`, every
    service's /metrics text is also written there as `<service>.prom`."""
    counters: dict[str, dict[str, float]] = {}
    for service in stack.services:
        with urllib.request.urlopen(service.metrics_url, timeout=10.0) as response:
            text = response.read().decode()
        if dump_dir is not None:
            dump_dir.mkdir(parents=True, exist_ok=True)
            (dump_dir / f"{service.name}.prom").write_text(text)
        if service.role != "worker":
            continue
        values = dict.fromkeys(_WORKER_COUNTERS.values(), 0.0)
        for family in text_string_to_metric_families(text):
            # Counters, and gauges read from cumulative engine or tier stats (`..._total`).
            cumulative = family.type == "counter" or family.name.endswith("_total") or \
                family.name.endswith(("engine_steps", "engine_step_seconds"))
            if not cumulative or not family.name.startswith(_WORKER_PREFIX):
                continue
            name = _WORKER_COUNTERS.get(family.name, family.name[len(_WORKER_PREFIX):])
            name = name.removesuffix("_total")
            values[name] = values.get(name, 0.0) + sum(
                s.value for s in family.samples
                if family.type != "counter" or s.name.endswith("_total"))
        counters[service.name] = values
    return counters


class GaugeSampler:
    """Every worker's running/waiting/free-block gauges every `period_s` while the bench
    runs (a thread), for `--metrics-dir`: shows queueing and imbalance over time."""

    GAUGES = ("running", "waiting", "kv_free_blocks")

    def __init__(self, stack: Stack, period_s: float = 0.25) -> None:
        self._urls = {s.name: s.metrics_url for s in stack.services if s.role == "worker"}
        self._period_s = period_s
        self._stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, name="gauge-sampler", daemon=True)
        self._began = 0.0

    def __enter__(self) -> Self:
        self._began = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            sample: dict[str, Any] = {"t": round(time.monotonic() - self._began, 3)}
            for name, url in self._urls.items():
                try:
                    with urllib.request.urlopen(url, timeout=2.0) as response:
                        text = response.read().decode()
                except OSError:
                    continue
                for family in text_string_to_metric_families(text):
                    short = family.name.removeprefix(_WORKER_PREFIX)
                    if short in self.GAUGES and family.samples:
                        sample[f"{name}.{short}"] = family.samples[0].value
            self.samples.append(sample)


def run_policy(args: argparse.Namespace, policy: str, extra: Sequence[str],
               workload: Workload | None) -> tuple[dict[str, Any], Workload]:
    """One fresh stack under `policy`, the bench on it; (the run's figures, the workload)."""
    launcher = launcher_config(args, policy, extra)
    config = serve_config(args, launcher)
    workload = workload or build_workload(config)
    timed, warm = split_warm(workload, args.warm_requests)
    say = (lambda line: print(f"[{policy}] {line}", file=sys.stderr, flush=True))
    environ = {**os.environ, **split_policy(policy)[1]}
    with start_stack(launcher, environ=environ, say=say) as stack:
        config = dataclasses.replace(config, base_url=stack.gateway_url)
        if warm is not None:  # closed loop, figures dropped: only the caches it leaves count
            asyncio.run(run_benchmark(dataclasses.replace(
                config, request_rate=math.inf, max_concurrency=args.warm_concurrency,
                progress=False), warm))
        with GaugeSampler(stack) as sampler:
            (result,) = asyncio.run(run_benchmark(config, timed))
        dump_dir = None if args.metrics_dir is None else args.metrics_dir / policy
        per_worker = worker_counters(stack, dump_dir)
    if dump_dir is not None:  # per request, in the workload's order; gauges over time
        (dump_dir / "requests.json").write_text(json.dumps(
            {key: result[key] for key in ("ttfts", "e2els", "errors") if key in result}))
        (dump_dir / "gauges.json").write_text(json.dumps(sampler.samples))
    scalars = {k: v for k, v in result.items() if not isinstance(v, list)}
    settings = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in launcher.as_dict().items()}
    return {"routing": policy, **scalars, "per_worker": per_worker, "launcher": settings}, \
        workload


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each kv-aware run over round-robin: output throughput, and round-robin's p90 TTFT
    over its (`kv_aware` in the key; `kv_aware@4` for a run with prefill weight 4)."""
    rr = runs.get("round-robin")
    if rr is None:
        return {}

    def over(a: float, b: float) -> float | None:
        return a / b if b else None

    found: dict[str, float | None] = {}
    for spec, kv in runs.items():
        if split_policy(spec)[0] != "kv-aware":
            continue
        name = spec.replace("-", "_")
        found[f"output_throughput_{name}_over_round_robin"] = over(
            kv["output_throughput"], rr["output_throughput"])
        found[f"p90_ttft_round_robin_over_{name}"] = over(rr["p90_ttft_ms"], kv["p90_ttft_ms"])
    return found


def versions() -> dict[str, Any]:
    """Where it ran. Torch is imported only now, after the stacks: this process never holds
    a CUDA context while the workers size their caches."""
    import torch

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": version("transformers"), "meshserve": version("meshserve"),
            "gpu": gpu}


def table(runs: dict[str, dict[str, Any]]) -> str:
    """One line per policy, for the terminal."""
    lines = ["routing        done  fail  out tok/s  ttft p50  ttft p90  ttft p99  cached"]
    for policy, r in runs.items():
        cached = r["cached_token_fraction"]
        lines.append(f"{policy:<13}{r['completed']:>6}{r['failed']:>6}"
                     f"{r['output_throughput']:>11.1f}{r['median_ttft_ms']:>10.1f}"
                     f"{r['p90_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>10.1f}"
                     f"{'-' if cached is None else f'{cached:.3f}':>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    command = [sys.executable, *(sys.argv if argv is None else [__file__, *argv])]
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    runs: dict[str, dict[str, Any]] = {}
    workload: Workload | None = None
    try:
        for policy in args.policies.split(","):
            runs[policy], workload = run_policy(args, policy, extra, workload)
            print(table({policy: runs[policy]}).splitlines()[1], flush=True)
    except ConfigError as exc:
        print(f"kv_routing: {exc.message}", file=sys.stderr)
        return 2
    except MeshError as exc:  # a stack that did not start, a server every warm-up failed on
        print(f"kv_routing: {exc.message}", file=sys.stderr)
        return 1
    report = {
        "benchmark": "kv_routing",
        "command": shlex.join(command),
        "model": args.model or "SmolLM2-135M-Instruct (default)", "launcher_flags": extra,
        "workers": args.workers,
        "workload": {"dataset": "prefix-heavy", "num_prompts": args.num_prompts,
                     "concurrency": args.concurrency or None,
                     "request_rate": "inf" if math.isinf(args.request_rate)
                     else args.request_rate, "seed": args.seed,
                     "prefix_tenants": args.prefix_tenants, "prefix_len": args.prefix_len,
                     "prefix_zipf_s": args.prefix_zipf_s,
                     "prefix_question_len": args.prefix_question_len,
                     "output_len": args.output_len, "num_warmup": args.num_warmup,
                     "warm_requests": args.warm_requests},
        "versions": versions(), "runs": runs, "ratios": ratios(runs)}
    print(table(runs))
    for name, value in report["ratios"].items():
        print(f"{name}: {'-' if value is None else f'{value:.2f}'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
