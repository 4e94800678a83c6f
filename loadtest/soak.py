"""The soak: a mixed load on the whole mesh while a random part is killed again and again.

    python loadtest/soak.py [--model PATH | --tiny] [--minutes 30] [--kill-every-s 30] \
        [--concurrency 8] [--parts gateway,tokenizer,worker,scheduler,kvstore,redis] \
        [--seed 0] --out soak.json [--summary soak.md]

Starts `meshserve up --workers 2 --tokenizers 2 --gateways 2` (start_stack; the default
model, a model folder, or with --tiny a tiny random Llama built by tests/tiny_models.py)
with a restart budget the run cannot exhaust, and keeps soak_load.py's mixed load on it
(streams, non-streamed chats, cancels mid-stream, bad inputs that must get a 4xx, long
prompts) for `--minutes`. Every `--kill-every-s` one service drawn at random (a gateway,
a tokenizer, a worker, the scheduler, the kvstore or the embedded Redis) gets SIGKILL; the
launcher's supervisor starts it again, and the next kill waits until it is back (healthy
on its address; registered again with a new epoch, for a worker: fault_matrix.py's
checks). Each process's RSS and private RSS are sampled every `--rss-every-s`. At the
end the load stops, the requests in flight finish, and the in-flight gauges of every
service must come back to zero (gateways' requests in flight, workers' running and
waiting, the scheduler's queue).

The JSON holds every request's fate (soak_load.py: completed, rejected, cancelled,
overloaded, gateway_cut listed apart, and the failures), every kill with the time until
the service was back, the restarts the launcher counted, the memory samples (RSS and private RSS) and
the gauges;
the markdown summary the totals. `ok` is true when no request failed, every killed
service came back and the gauges are at zero. tests/e2e/test_soak_smoke.py runs it
briefly on the tiny model in CI; loadtest/reports/soak/ holds the long runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts

import fault_matrix
from soak_load import FAILURES, Fate, Load, tally

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

PARTS = ("gateway", "tokenizer", "worker", "scheduler", "kvstore", "redis")
# Gauges of requests in flight: zero once the load has stopped and its requests ended.
ZERO_GAUGES = ("meshserve:gateway_requests_in_flight", "vllm:num_requests_running",
               "vllm:num_requests_waiting", "meshserve:scheduler_queue_depth")
_GAUGES_WAIT_S = 30.0
_BACK_POLL_S = 0.1
_LISTED = 200  # requests listed one by one per kind of fate in the JSON


@dataclasses.dataclass
class Kill:
    """One SIGKILL and its recovery (seconds since the load started)."""

    at_s: float
    part: str
    service: str
    back_s: float | None  # kill to healthy again (None: not within the wait)


@dataclasses.dataclass
class SoakOptions:
    """What one soak runs (the command line's flags)."""

    minutes: float = 30.0
    kill_every_s: float = 30.0
    parts: tuple[str, ...] = PARTS
    concurrency: int = 8
    max_tokens: int = 32
    long_prompt_tokens: int = 1024
    request_timeout_s: float = 180.0
    back_timeout_s: float = 120.0
    rss_every_s: float = 5.0
    seed: int = 0


class RssSampler:
    """Every `every_s`, the memory of each child process (its current pid: restarts change
    it), from a thread of its own: [RSS, private RSS] in MiB. Private is RssAnon: RSS less
    mapped files and shared memory (a worker maps the kvstore's shared region and its RSS
    counts the pages it wrote there, up to the kvstore's capacity)."""

    def __init__(self, stack: Stack, every_s: float, clock: Any) -> None:
        self.stack = stack
        self.every_s = every_s
        self.clock = clock
        self.names = [s.name for s in stack.services] + (["redis"] if stack.pid("redis")
                                                          else [])
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every_s):
                return

    def sample(self) -> None:
        pids = {name: self.stack.pid(name) for name in self.names}
        mib = {name: _memory_mib(pid) for name, pid in pids.items()}
        self.samples.append({"t_s": round(self.clock(), 1), "mib": mib, "pid": pids})


def _memory_mib(pid: int | None) -> list[float] | None:
    """[VmRSS, RssAnon] of a process in MiB (None: not running)."""
    if pid is None:
        return None
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        return None  # it died between the pid and the read
    return [fields["VmRSS"], fields["RssAnon"]] if len(fields) == 2 else None


def kill_targets(stack: Stack, parts: tuple[str, ...]) -> list[tuple[str, str]]:
    """(part, service name) of every process the soak may kill."""
    names = {"gateway": stack.gateway_names, "worker": stack.worker_ids,
             "tokenizer": [s.name for s in stack.services if s.role == "tokenizer"],
             "scheduler": ["scheduler"],
             "kvstore": ["kvstore"] if stack.kvstore_address else [],
             "redis": ["redis"] if stack.pid("redis") else []}
    return [(part, name) for part in parts for name in names[part]]


async def _kill_and_wait_back(stack: Stack, load: Load, part: str, service: str,
                              timeout_s: float) -> Kill:
    """SIGKILL `service`, then wait until it is back (bounded)."""
    epoch = None
    if part == "worker":
        await fault_matrix._every_worker_listed(stack, timeout_s)
        epoch = (await asyncio.to_thread(fault_matrix._running_per_worker, stack))[service][1]
    pid = stack.pid(service)
    at = load.now()
    if part == "gateway":
        load.gateway_kills.append(at)  # before the kill: its cut requests end after it
    stack.kill(service, signal.SIGKILL)
    while load.now() - at < timeout_s:
        # A new process (not the killed one seen before it died), healthy.
        if stack.pid(service) not in (None, pid) and await asyncio.to_thread(
                fault_matrix._part_back, stack, part, service, epoch):
            return Kill(round(at, 2), part, service, round(load.now() - at, 2))
        await asyncio.sleep(_BACK_POLL_S)  # polling: a restart sends no signal to us
    return Kill(round(at, 2), part, service, None)


async def kill_loop(stack: Stack, load: Load, options: SoakOptions) -> list[Kill]:
    """A random part killed every `kill_every_s` until the soak's end; the next kill waits
    until the last one's service is back."""
    rng = random.Random(options.seed)
    targets = kill_targets(stack, options.parts)
    end_s = options.minutes * 60
    kills: list[Kill] = []
    next_s = options.kill_every_s
    while next_s < end_s and targets:
        await asyncio.sleep(max(next_s - load.now(), 0.0))  # the schedule, not a sync
        part, service = rng.choice(targets)
        kill = await _kill_and_wait_back(stack, load, part, service, options.back_timeout_s)
        kills.append(kill)
        if kill.back_s is None:
            break  # a service that stays away ends the kills: the report says which
        next_s = max(next_s + options.kill_every_s, load.now())
    await asyncio.sleep(max(end_s - load.now(), 0.0))
    return kills


def scrape_gauges(stack: Stack) -> dict[str, dict[str, float]]:
    """service -> {sample name with labels: value} of the ZERO_GAUGES it exports."""
    found: dict[str, dict[str, float]] = {}
    for name, url in stack.metrics_urls.items():
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ZERO_GAUGES:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    key = f"{sample.name}{{{labels}}}" if labels else sample.name
                    found.setdefault(name, {})[key] = sample.value
    return found


async def settled_gauges(stack: Stack) -> tuple[dict[str, dict[str, float]], bool]:
    """The in-flight gauges once all are zero (or as they are after _GAUGES_WAIT_S)."""
    deadline = time.monotonic() + _GAUGES_WAIT_S
    while True:
        gauges = await asyncio.to_thread(scrape_gauges, stack)
        zero = all(v == 0 for values in gauges.values() for v in values.values())
        if zero or time.monotonic() > deadline:
            return gauges, zero
        await asyncio.sleep(0.5)  # polling: gauges are read on scrape only


def max_model_len(stack: Stack) -> int:
    with urllib.request.urlopen(f"{stack.base_url}/models", timeout=10) as response:
        return int(json.loads(response.read())["data"][0]["max_model_len"])


async def soak(stack: Stack, options: SoakOptions) -> dict[str, Any]:
    """Run the load and the kills for `options.minutes`; the report (without the stack's
    description)."""
    load = Load(stack.base_url, stack.model_names()[0], max_model_len=max_model_len(stack),
                concurrency=options.concurrency, max_tokens=options.max_tokens,
                long_prompt_tokens=options.long_prompt_tokens,
                timeout_s=options.request_timeout_s, seed=options.seed)
    sampler = RssSampler(stack, options.rss_every_s, load.now)
    sampler.start()
    running = asyncio.ensure_future(load.run())
    try:
        kills = await kill_loop(stack, load, options)
    finally:
        load.stop()
        await running
    load_s = load.now()
    gauges, zero = await settled_gauges(stack)
    await asyncio.to_thread(sampler.stop)
    return report(stack, load, kills, sampler.samples, gauges, zero, load_s)


def report(stack: Stack, load: Load, kills: list[Kill], samples: list[dict[str, Any]],
           gauges: dict[str, dict[str, float]], gauges_zero: bool,
           load_s: float) -> dict[str, Any]:
    counts = tally(load.fates)
    failed = [f for f in load.fates if f.outcome in FAILURES]
    restarts = {name: stack.restarts(name) for name in sampler_names(samples)}
    every_back = all(k.back_s is not None for k in kills)
    return {
        "ok": not failed and every_back and gauges_zero and stack.running(),
        "load_s": round(load_s, 1), "requests": len(load.fates), "outcomes": counts,
        # A part that fails requests fails them fast: the first ones, and all by kind.
        "failures": [dataclasses.asdict(f) for f in failed[:_LISTED]],
        "failure_groups": failure_groups(failed),
        "gateway_cut": [dataclasses.asdict(f) for f in load.fates
                        if f.outcome == "gateway_cut"][:_LISTED],
        "per_kind": {kind: tally([f for f in load.fates if f.kind == kind])
                     for kind in sorted({f.kind for f in load.fates})},
        "kills": [dataclasses.asdict(k) for k in kills], "every_kill_back": every_back,
        "restarts": restarts, "gauges": gauges, "gauges_zero": gauges_zero,
        "stack_up": stack.running(), "rss": rss_summary(samples), "rss_samples": samples}


def failure_groups(failed: list[Fate]) -> list[dict[str, Any]]:
    """The failures grouped by outcome, status and the start of their detail, most first."""
    groups: dict[tuple[str, int | None, str], int] = {}
    for fate in failed:
        key = (fate.outcome, fate.status, (fate.detail or "")[:160])
        groups[key] = groups.get(key, 0) + 1
    return [{"outcome": o, "status": s, "detail": d, "requests": n}
            for (o, s, d), n in sorted(groups.items(), key=lambda kv: -kv[1])]


def sampler_names(samples: list[dict[str, Any]]) -> list[str]:
    return list(samples[0]["mib"]) if samples else []


def rss_summary(samples: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per process, over the life of its last pid (a restart starts afresh): private RSS
    (MiB) at its first sample, a minute later, the most, the last, and last / a-minute-in
    (the soak's memory check for workers); the most and last of RSS in all; its restarts
    seen (pids that came and went)."""
    out: dict[str, dict[str, float | None]] = {}
    for name in sampler_names(samples):
        lives = [s for s in samples if s["mib"][name] is not None]
        if not lives:
            continue
        pid = lives[-1]["pid"][name]
        series = [(s["t_s"], *s["mib"][name]) for s in lives if s["pid"][name] == pid]
        born = series[0][0]
        minute = next((anon for t, _, anon in series if t >= born + 60), series[-1][2])
        last = series[-1][2]
        out[name] = {"first": series[0][2], "after_1_min": minute,
                     "max": max(anon for _, _, anon in series), "last": last,
                     "last_vs_1_min": round(last / minute, 3) if minute else None,
                     "rss_max": max(rss for _, rss, _ in series), "rss_last": series[-1][1],
                     "pids": len({s["pid"][name] for s in lives})}
    return out


def summary_markdown(result: dict[str, Any]) -> str:
    """A short markdown account of one soak."""
    verdict = "ok" if result["ok"] else "FAILED"
    title = (f"# Soak: {result['model']}, {result['minutes']:g} min, a kill every "
             f"{result['kill_every_s']:g} s ({verdict})")
    scale = (f"{result['requests']} requests in {result['load_s']:g} s on "
             f"{result['cpu_count']} CPU cores, concurrency {result['concurrency']}.")
    failed = sum(result["outcomes"].get(name, 0) for name in FAILURES)
    losses = (f"Failures (lost, 5xx, error events, unexpected, hung): {failed}. Cut by a "
              f"killed gateway: {len(result['gateway_cut'])} (listed in the JSON).")
    kills = (f"Kills: {len(result['kills'])}; every service back: "
             f"{result['every_kill_back']}.")
    lines = [title, "", scale, "", "| outcome | requests |", "|---|---|"]
    lines += [f"| {name} | {count} |" for name, count in result["outcomes"].items()]
    lines += ["", losses]
    lines += [f"- {g['requests']} x {g['outcome']} ({g['status']}): {g['detail'][:100]}"
              for g in result["failure_groups"][:5]]
    lines += ["", kills, "", "| part | kills | slowest back (s) |", "|---|---|---|"]
    for part in PARTS:
        backs = [k["back_s"] for k in result["kills"] if k["part"] == part]
        if backs:
            slowest = max((b for b in backs if b is not None), default=None)
            lines.append(f"| {part} | {len(backs)} | {slowest} |")
    lines += ["", f"Gauges back to zero: {result['gauges_zero']}.", "",
              "Private RSS (RssAnon, MiB) of each process since its last start (processes: "
              + "how many it had); RSS adds mapped files and shared memory:", "",
              "| process | processes | first | after 1 min | max | last | last / 1 min | "
              + "RSS max | RSS last |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rss in result["rss"].items():
        lines.append(f"| {name} | {rss['pids']} | {rss['first']} | {rss['after_1_min']} | "
                     f"{rss['max']} | {rss['last']} | {rss['last_vs_1_min']} | "
                     f"{rss['rss_max']} | {rss['rss_last']} |")
    return "\n".join(lines) + "\n"


def _tiny_model(folder: Path) -> str:
    """A tiny random Llama (tests/tiny_models.py), as the CI test serves."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import build_tiny_model

    return str(build_tiny_model(folder, "llama", seed=7, max_position_embeddings=4096))


def stack_config(model: str | None, options: SoakOptions, run_dir: str | None,
                 tiny: bool) -> LauncherConfig:
    """Two workers, two tokenizers, two gateways; a restart budget no soak exhausts."""
    kills = int(options.minutes * 60 / options.kill_every_s) + 1
    engine: dict[str, Any] = {"num_kv_blocks": 512, "dtype": "float32"} if tiny else {}
    return LauncherConfig(model=model, served_model_name="model", workers=2, tokenizers=2,
                          gateways=2, port=0, device="cpu", restart_budget=kills + 5,
                          startup_timeout_s=600, stop_grace_s=10, run_dir=run_dir, **engine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead")
    defaults = SoakOptions()
    for field in dataclasses.fields(SoakOptions):
        if field.name != "parts":
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(
                getattr(defaults, field.name)), default=getattr(defaults, field.name))
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--run-dir", default=None, help="keep the services' logs there")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summary", type=Path, default=None)
    args = parser.parse_args(argv)
    options = SoakOptions(**{f.name: getattr(args, f.name)
                             for f in dataclasses.fields(SoakOptions) if f.name != "parts"},
                          parts=tuple(args.parts.split(",")))
    assert set(options.parts) <= set(PARTS), f"--parts must be among {PARTS}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = _tiny_model(Path(tempfile.mkdtemp(prefix="soak-model-"))) if args.tiny \
        else args.model
    config = stack_config(model, options, args.run_dir, args.tiny)
    with start_stack(config, say=lambda line: print(line, file=sys.stderr, flush=True)) as stack:
        result = asyncio.run(soak(stack, options))
    result.update(model="tiny random Llama" if args.tiny else args.model
                  or "SmolLM2-135M-Instruct (default)", cpu_count=os.cpu_count(),
                  **{k: v for k, v in dataclasses.asdict(options).items()})
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    text = summary_markdown(result)
    if args.summary is not None:
        args.summary.write_text(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
