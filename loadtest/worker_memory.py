"""What holds a worker's memory after a burst: RSS at start, peak, after, after malloc_trim.

The figures: loadtest/reports/memory/README.md.

    python loadtest/worker_memory.py [--model PATH] [--workers 1] [--requests 300] \
        [--disconnect 100] [--max-tokens 32] [--bursts 2] [--settle-s 5] [--arena-max N] \
        [--no-idle-trim] [--tracemalloc FRAMES] --out m.json

Starts `meshserve up` (start_stack) with a probe on every child's PYTHONPATH (a
sitecustomize written to a temporary folder): on SIGUSR2 a process reads a command file
and answers, into a file beside it, either a census (after a full collection: live Python
objects per type outside the frozen heap, glibc's mallinfo2 over every arena: bytes in
use and free; with --tracemalloc a snapshot too) or a trim (`malloc_trim(0)`, then
mallinfo2 again). The script sends a few requests (warm-up), idles `--settle-s`, takes
each worker's memory (RSS split into private, shared memory and files; resident MiB per
kind of mapping from smaps) and census; then per burst `--requests` concurrent
completions and `--disconnect` streams it drops after their first chunk, sampling private
RSS every 0.2 s, waits until the workers are idle, idles `--settle-s`, and takes memory
and census again; at the end it trims and reads memory once more. The census diff says
whether Python objects grew (a leak, an unbounded cache); free bytes inside malloc that a
trim hands back say the growth sat in allocator arenas; RssShmem is the kvstore's shared
region the worker writes saved blocks into. `--bursts N` shows growth from one burst to
the next apart from the first burst's. `--arena-max N` sets MALLOC_ARENA_MAX for the
stack; `--no-idle-trim` turns the workers' idle trim off (MESHSERVE_IDLE_TRIM_INTERVAL_S=0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

import aiohttp

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

_SAMPLE_S = 0.2
_PROBE_TIMEOUT_S = 60.0
# Loaded by every child through PYTHONPATH; it does nothing unless MEMPROBE_DIR is set.
_PROBE = '''
import ctypes, gc, json, os, signal

def _mallinfo():
    class M(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = M
    m = libc.mallinfo2()
    return {"sbrk_and_arenas": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks,
            "free_in_arenas": m.fordblks, "top_releasable": m.keepcost}

def _snapshot(base):
    import tracemalloc
    if not tracemalloc.is_tracing():
        return None
    n = len([f for f in os.listdir(os.path.dirname(base)) if f.startswith(
        os.path.basename(base) + ".") and f.endswith(".snap")])
    path = f"{base}.{n}.snap"
    tracemalloc.take_snapshot().dump(path)
    return path

def _answer(signum, frame):
    base = os.path.join(os.environ["MEMPROBE_DIR"], str(os.getpid()))
    with open(base + ".cmd") as f:
        command = f.read().strip()
    if command == "trim":
        released = ctypes.CDLL("libc.so.6").malloc_trim(0)
        answer = {"released": released, "malloc": _mallinfo()}
    else:
        gc.collect()
        counts = {}
        for obj in gc.get_objects():
            name = type(obj).__qualname__
            counts[name] = counts.get(name, 0) + 1
        answer = {"objects": sum(counts.values()), "per_type": counts,
                  "frozen": gc.get_freeze_count(), "malloc": _mallinfo(),
                  "snapshot": _snapshot(base)}
    with open(base + ".tmp", "w") as f:
        json.dump(answer, f)
    os.replace(base + ".tmp", base + ".json")

if os.environ.get("MEMPROBE_DIR"):
    signal.signal(signal.SIGUSR2, _answer)
    with open("/proc/self/cmdline", "rb") as f:
        worker = b"meshserve.services.worker" in f.read()
    if worker and os.environ.get("MEMPROBE_TRACEMALLOC"):
        import tracemalloc
        tracemalloc.start(int(os.environ["MEMPROBE_TRACEMALLOC"]))
'''


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of a process (VmRSS), or one of its parts (RssAnon: private
    memory; RssShmem: shared memory, e.g. the kvstore's region the worker writes blocks
    into), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def rss_parts(pid: int) -> dict[str, int]:
    """MiB resident: in all, private (anon), shared memory, mapped files."""
    return {name: rss_bytes(pid, field) // 2 ** 20 for name, field in (
        ("rss", "VmRSS"), ("anon", "RssAnon"), ("shmem", "RssShmem"), ("file", "RssFile"))}


def smaps_mib(pid: int) -> dict[str, int]:
    """Resident MiB by kind of mapping: malloc's main heap, anonymous mappings by size
    (glibc's other arenas reserve 64 MiB each; large tensors get mappings of their own),
    thread stacks, files."""
    out: dict[str, int] = {}
    kind = "file"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            start, end = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5] if len(fields) > 5 else ""
            size = end - start
            kind = (name.strip("[]") if name.startswith("[") else "file" if name
                    else "anon <= 1 MiB" if size <= 2 ** 20
                    else "anon <= 64 MiB" if size <= 2 ** 26 else "anon > 64 MiB")
        elif fields[0] == "Rss:":
            out[kind] = out.get(kind, 0) + int(fields[1])
    return {k: v // 1024 for k, v in sorted(out.items())}


def top_growth(first: str | None, last: str | None, top: int = 12) -> list[str]:
    """tracemalloc: the source lines whose traced memory grew most between two snapshots."""
    if not (first and last):
        return []
    import tracemalloc

    old, new = tracemalloc.Snapshot.load(first), tracemalloc.Snapshot.load(last)
    return [str(stat) for stat in new.compare_to(old, "lineno")[:top]]


def ask(probe_dir: Path, pid: int, command: str) -> dict[str, Any]:
    """Have process `pid`'s probe run `command` (census or trim); its answer."""
    answer = probe_dir / f"{pid}.json"
    answer.unlink(missing_ok=True)
    (probe_dir / f"{pid}.cmd").write_text(command)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + _PROBE_TIMEOUT_S
    while not answer.exists():  # polling: the answer is a file the child writes
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} did not answer {command!r}")
        time.sleep(0.05)
    return json.loads(answer.read_text())


class RssSampler:
    """Samples the RSS of some processes every _SAMPLE_S in a thread; keeps the peaks."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = {name: 0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_bytes(pid, "RssAnon"))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def burst(stack: Stack, model: str, requests: int, disconnect: int,
                max_tokens: int) -> dict[str, int]:
    """`requests` completions at once and `disconnect` streams dropped after one chunk;
    their outcomes counted by HTTP status (`dropped` for the disconnected)."""
    url = f"{stack.base_url}/completions"
    outcomes: dict[str, int] = {}

    async def one(session: aiohttp.ClientSession, i: int, drop: bool) -> None:
        body = {"model": model, "prompt": f"{i}: tell me about the sea and its ships.",
                "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True,
                "stream": drop}
        async with session.post(url, json=body) as response:
            if drop and response.status == 200:
                await response.content.readline()
                response.close()  # the client goes away mid-stream
                key = "dropped"
            else:
                await response.read()
                key = str(response.status)
        outcomes[key] = outcomes.get(key, 0) + 1

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        await asyncio.gather(*(one(session, i, i < disconnect)
                               for i in range(requests + disconnect)))
    return outcomes


def wait_idle(stack: Stack, timeout_s: float = 600.0) -> None:
    """Until every worker reports nothing running or waiting (dropped streams end late)."""
    import grpc

    from meshserve.proto.v1 import worker_pb2, worker_pb2_grpc

    deadline = time.monotonic() + timeout_s
    for address in stack.worker_addresses:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            while True:
                load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5.0).load
                if not (load.num_running or load.num_waiting):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{address} still busy after {timeout_s}s")
                time.sleep(0.2)  # polling: the load is only read on request


def census_diff(before: dict[str, Any], after: dict[str, Any], top: int = 15) -> dict[str, int]:
    """The types whose live object count changed most."""
    names = set(before["per_type"]) | set(after["per_type"])
    change = {n: after["per_type"].get(n, 0) - before["per_type"].get(n, 0) for n in names}
    return dict(sorted(change.items(), key=lambda kv: -abs(kv[1]))[:top])


def _burst_and_idle(stack: Stack, workers: dict[str, int], args: argparse.Namespace,
                    probe_dir: Path) -> dict[str, Any]:
    """One burst, RSS sampled; then idle `--settle-s`: RSS and census after it."""
    began = time.monotonic()
    with RssSampler(workers) as sampler:
        outcomes = asyncio.run(burst(stack, "model", args.requests, args.disconnect,
                                     args.max_tokens))
        wait_idle(stack)
    burst_s = time.monotonic() - began
    time.sleep(args.settle_s)  # the worker's idle trim, if on, runs within this
    return {"outcomes": outcomes, "burst_s": round(burst_s, 1), "peak": sampler.peak,
            "after": {n: rss_parts(p) for n, p in workers.items()},
            "smaps": {n: smaps_mib(p) for n, p in workers.items()},
            "census": {n: ask(probe_dir, p, "census") for n, p in workers.items()}}


def measure(stack: Stack, probe_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    pids = {name: stack.pid(name) for name in stack.worker_ids}
    assert all(pids.values()), pids
    workers = {name: int(pid) for name, pid in pids.items() if pid}
    asyncio.run(burst(stack, "model", 8, 0, 8))  # warm-up: every path run once
    wait_idle(stack)
    time.sleep(args.settle_s)
    start = {n: rss_parts(p) for n, p in workers.items()}
    smaps_start = {n: smaps_mib(p) for n, p in workers.items()}
    census_start = {n: ask(probe_dir, p, "census") for n, p in workers.items()}
    bursts = [_burst_and_idle(stack, workers, args, probe_dir) for _ in range(args.bursts)]
    trims = {n: ask(probe_dir, p, "trim") for n, p in workers.items()}
    after_trim = {n: rss_parts(p) for n, p in workers.items()}
    mib = 2 ** 20
    last = bursts[-1]["census"]
    return {"bursts": [{"outcomes": b["outcomes"], "burst_s": b["burst_s"]} for b in bursts],
            "workers": {n: {
                "rss_mib": {"start": start[n],
                            "peak_anon": [b["peak"][n] // mib for b in bursts],
                            "after": [b["after"][n] for b in bursts],
                            "after_trim": after_trim[n]},
                "objects": {"start": census_start[n]["objects"],
                            "after": [b["census"][n]["objects"] for b in bursts]},
                "object_change_by_type": census_diff(census_start[n], last[n]),
                "smaps_mib": {"start": smaps_start[n],
                              "after": [b["smaps"][n] for b in bursts]},
                "traced_growth": top_growth(census_start[n]["snapshot"],
                                            last[n]["snapshot"]),
                "malloc_mib": {when: {k: v // mib for k, v in info.items()} for when, info in (
                    ("start", census_start[n]["malloc"]), ("after", last[n]["malloc"]),
                    ("after_trim", trims[n]["malloc"]))}} for n in workers}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--disconnect", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="idle time before the after-burst figures")
    parser.add_argument("--arena-max", type=int, default=None, help="MALLOC_ARENA_MAX")
    parser.add_argument("--tracemalloc", type=int, default=0,
                        help="frames per traced allocation in the workers (0: off)")
    parser.add_argument("--no-idle-trim", action="store_true",
                        help="the workers' idle trim off (--idle-trim-interval-s 0)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    probe_dir = Path(tempfile.mkdtemp(prefix="memprobe-"))
    (probe_dir / "sitecustomize.py").write_text(_PROBE)
    environ = {**os.environ, "MEMPROBE_DIR": str(probe_dir), "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(
                   filter(None, [str(probe_dir), os.environ.get("PYTHONPATH")]))}
    if args.arena_max is not None:
        environ["MALLOC_ARENA_MAX"] = str(args.arena_max)
    if args.tracemalloc:
        environ["MEMPROBE_TRACEMALLOC"] = str(args.tracemalloc)
    if args.no_idle_trim:
        environ["MESHSERVE_IDLE_TRIM_INTERVAL_S"] = "0"  # the workers' config reads it
    config = LauncherConfig(model=args.model, served_model_name="model", workers=args.workers,
                            port=0, device="cpu", startup_timeout_s=600, stop_grace_s=10)
    with start_stack(config, environ=environ,
                     say=lambda line: print(line, file=sys.stderr, flush=True)) as stack:
        result = measure(stack, probe_dir, args)
    result.update(model=args.model or "SmolLM2-135M-Instruct (default)",
                  cpu_count=os.cpu_count(), arena_max=args.arena_max,
                  idle_trim=not args.no_idle_trim, requests=args.requests,
                  disconnect=args.disconnect, max_tokens=args.max_tokens)
    text = json.dumps(result, indent=2) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
