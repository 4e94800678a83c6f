"""The gateway's CPU cost per streamed token, measured without a GPU.

Driver part: none (a CPU benchmark, run by hand; figures in loadtest/reports/gateway-cost/).

    python loadtest/gateway_cost.py --streams 256,1000 --tokens 64 \
        --out loadtest/reports/gateway-cost/after.json --profile-streams 1000

The gateway runs as `meshserve up` starts it (`python -m meshserve.services.gateway`, its
own process), so its CPU time is read from /proc for that process alone. Everything else
runs in this driver process, whose CPU does not count: fake tokenizer, scheduler and
worker servicers on real grpc.aio servers, and aiohttp clients reading the SSE.

The fakes cost the gateway what real services would and nothing more: the worker sends one
Session message per engine step carrying every running stream's new tokens (columnar,
`--tokens-per-step` each), the tokenizer answers one DetokenizeSession message per message
with one character per token (byte-level ids of lowercase letters), the scheduler routes
every request to the one worker. Each of `--streams S` clients sends one streamed chat
request for exactly `--tokens T` tokens (`ignore_eos`, `stream_options.include_usage`); the
report counts the characters the clients read and the usage they were told, next to the
tokens the worker sent. With `--step-ms`, the worker steps no faster than an engine would
(each step then carries every stream). With `--profile-streams`, one more burst runs on a
fresh gateway with py-spy (`pip install py-spy`) sampling it for that burst only; its figures
are reported apart from the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson

from meshserve.bench.serve.client import sse_events
from meshserve.proto.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from meshserve.shared.grpc_server import GrpcServer

MODEL = "tiny"
MAX_MODEL_LEN = 1 << 16
_LETTERS = 26
_A = ord("a")
_STARTUP_S = 60.0  # the gateway's start (imports, channels) must finish within this
PROFILE_RATE_HZ = 250
_REPO = f"{Path(__file__).resolve().parents[1]}/"
_STDLIB = re.compile(r"^.*/python3\.\d+/")


def token_of(position: int) -> int:
    """The token the fake worker sends at output position `position` (a lowercase letter)."""
    return _A + position % _LETTERS


# -- fakes ----------------------------------------------------------------------------------

class CostTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Byte-level Tokenize; DetokenizeSession answering one character per token."""

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        if request.WhichOneof("input") == "chat":
            text = "".join(m.content for m in request.chat.messages)
        else:
            text = request.text
        return tokenizer_pb2.TokenizeResponse(token_ids=list(text.encode()), prompt_text=text,
                                              max_model_len=MAX_MODEL_LEN)

    async def DetokenizeSession(self, request_iterator: Any,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        counts: dict[tuple[int, int], int] = {}
        async for message in request_iterator:
            data = bytes(message.token_ids)
            texts, totals = [], []
            position = 0
            for handle, index, size in zip(message.handles, message.indices,
                                           message.num_tokens, strict=True):
                texts.append(data[position:position + size].decode())
                position += size
                key = (handle, index)
                counts[key] = totals_at = counts.get(key, 0) + size
                totals.append(totals_at)
            for handle in message.closes:
                counts = {k: v for k, v in counts.items() if k[0] != handle}
            yield tokenizer_pb2.DetokenizeSessionResponse(
                texts=texts, stopped=[False] * len(texts), finished=list(message.finals),
                num_output_tokens=totals,
                token_bytes=[bytes([t % 256]) for t in message.lookup_token_ids])


class CostScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Routes every request to the one worker."""

    def __init__(self, worker_address: str) -> None:
        self.worker_address = worker_address

    async def RouteSession(self, request_iterator: Any,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        route = scheduler_pb2.RouteResponse(worker_id="w0", address=self.worker_address,
                                            epoch=1, block_size=16)
        async for message in request_iterator:
            if message.routes:
                yield scheduler_pb2.RouteSessionResponse(outcomes=[
                    scheduler_pb2.RouteOutcome(ticket=t.ticket, route=route)
                    for t in message.routes])

    async def ListWorkers(self, request: scheduler_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.ListWorkersResponse:
        return scheduler_pb2.ListWorkersResponse(workers=[scheduler_pb2.WorkerStatus(
            info=common_pb2.WorkerInfo(worker_id="w0", address=self.worker_address,
                                       model_names=[MODEL], max_model_len=MAX_MODEL_LEN))])


@dataclass
class _Running:
    """One request on the fake worker: its sequence 0, tokens sent so far."""

    limit: int
    sent: int = 0


@dataclass
class WorkerCounts:
    """What the fake worker sent over every session."""

    tokens: int = 0
    steps: int = 0  # messages carrying tokens
    stream_steps: int = 0  # entries of those messages (one per running stream per step)


class CostWorker(worker_pb2_grpc.WorkerServicer):
    """An engine stepping as fast as the gateway reads: one message per step carrying
    `tokens_per_step` new tokens of every running request, finished ones marked done."""

    def __init__(self, tokens_per_step: int, step_s: float = 0.0) -> None:
        """`step_s`: the shortest time between two steps (an engine's step time; 0: none)."""
        self.tokens_per_step = tokens_per_step
        self.step_s = step_s
        self.counts = WorkerCounts()

    async def Session(self, request_iterator: Any,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        running: dict[int, _Running] = {}
        arrived = asyncio.Event()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    for add in message.adds:
                        running[add.handle] = _Running(add.request.params.max_tokens)
                    for abort in message.aborts:
                        running.pop(abort.handle, None)
                    arrived.set()
            finally:
                arrived.set()  # the gateway closed the session

        reader = asyncio.ensure_future(read())
        try:
            while not reader.done() or running:
                if not running:
                    arrived.clear()
                    if not reader.done():
                        await arrived.wait()
                    continue
                next_step = asyncio.get_running_loop().time() + self.step_s
                yield self._step(running)
                # Adds and aborts come in between steps (always: a zero sleep yields too).
                await asyncio.sleep(max(0.0, next_step - asyncio.get_running_loop().time()))
        finally:
            reader.cancel()

    def _step(self, running: dict[int, _Running]) -> worker_pb2.SessionResponse:
        response = worker_pb2.SessionResponse(num_steps=1)
        handles: list[int] = []
        sizes: list[int] = []
        tokens: list[int] = []
        reasons: list[int] = []
        done: list[worker_pb2.RequestDone] = []
        for handle, run in list(running.items()):
            size = min(self.tokens_per_step, run.limit - run.sent)
            tokens.extend(token_of(run.sent + i) for i in range(size))
            run.sent += size
            handles.append(handle)
            sizes.append(size)
            finished = run.sent >= run.limit
            reasons.append(common_pb2.FINISH_REASON_LENGTH if finished
                           else common_pb2.FINISH_REASON_UNSPECIFIED)
            if finished:
                del running[handle]
                done.append(worker_pb2.RequestDone(handle=handle))
        response.handles.extend(handles)
        response.indices.extend([0] * len(handles))
        response.num_tokens.extend(sizes)
        response.token_ids.extend(tokens)
        response.finish_reasons.extend(reasons)
        response.done.extend(done)
        self.counts.tokens += len(tokens)
        self.counts.steps += 1
        self.counts.stream_steps += len(handles)
        return response


async def _serve(name: str, add: Any, servicer: Any) -> tuple[GrpcServer, str]:
    server = GrpcServer("127.0.0.1:0", service_names=[f"meshserve.v1.{name}"], grace_s=0)
    add(servicer, server.server)
    port = await server.start()
    await server.set_serving()
    return server, f"127.0.0.1:{port}"


# -- the gateway process --------------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    """`python -m meshserve.services.gateway` and its CPU time."""

    def __init__(self, tokenizer: str, scheduler: str, log: Any) -> None:
        """`log`: the file its log lines (INFO and the access log, as `meshserve up`) go to."""
        self.port = _free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "meshserve.services.gateway", "--host", "127.0.0.1",
             "--port", str(self.port), "--tokenizer-addresses", tokenizer,
             "--scheduler-address", scheduler, "--served-model-names", MODEL],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> tuple[float, float]:
        """User and system CPU seconds of the gateway process so far (all its threads)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick

    async def ready(self, session: aiohttp.ClientSession) -> None:
        """Wait until the gateway lists the model (its start is bounded by _STARTUP_S)."""
        deadline = time.monotonic() + _STARTUP_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.process.returncode}")
            try:
                async with session.get(f"{self.url}/v1/models") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            await asyncio.sleep(0.1)  # a start, not a synchronization inside the run

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)


# -- clients --------------------------------------------------------------------------------

@dataclass
class StreamResult:
    chars: int = 0
    usage_tokens: int = 0
    done: bool = False


async def stream_one(session: aiohttp.ClientSession, url: str, tokens: int,
                     number: int) -> StreamResult:
    """One streamed chat request, its events read as they arrive."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"prompt {number}"}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = StreamResult()
    async with session.post(f"{url}/v1/chat/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        async for payload in sse_events(answer):
            if payload == b"[DONE]":
                result.done = True
                break
            chunk = orjson.loads(payload)
            for choice in chunk["choices"]:
                result.chars += len(choice["delta"].get("content") or "")
            if chunk.get("usage") and not chunk["choices"]:
                result.usage_tokens = chunk["usage"]["completion_tokens"]
    return result


@dataclass
class Burst:
    """One burst of S streams of T tokens and what it cost the gateway."""

    streams: int
    tokens_per_stream: int
    tokens_per_step: int
    tokens_sent: int  # by the worker
    tokens_read: int  # characters the clients read (one per token)
    usage_tokens: int  # completion_tokens the usage chunks reported, summed
    streams_done: int  # streams that ended with [DONE]
    worker_steps: int
    stream_steps: int  # (stream, step) pairs: entries of the worker's messages
    wall_s: float
    gateway_user_s: float
    gateway_sys_s: float  # the kernel's part: socket sends (SSE, gRPC) and polls, mostly
    gateway_cpu_s: float = field(init=False)
    us_per_token: float = field(init=False)
    us_per_stream_step: float = field(init=False)
    tokens_per_core_s: float = field(init=False)
    gateway_core_share: float = field(init=False)  # CPU seconds per wall second

    def __post_init__(self) -> None:
        self.gateway_cpu_s = round(self.gateway_user_s + self.gateway_sys_s, 3)
        cpu_us = self.gateway_cpu_s * 1e6
        self.us_per_token = round(cpu_us / max(self.tokens_sent, 1), 2)
        self.us_per_stream_step = round(cpu_us / max(self.stream_steps, 1), 2)
        self.tokens_per_core_s = round(self.tokens_sent / max(self.gateway_cpu_s, 1e-9))
        self.gateway_core_share = round(self.gateway_cpu_s / max(self.wall_s, 1e-9), 3)


async def burst(gateway: GatewayProcess, worker: CostWorker, session: aiohttp.ClientSession,
                streams: int, tokens: int) -> Burst:
    """S streams at once; the gateway's CPU time from the first request to the last byte."""
    before = asdict(worker.counts)
    (user, system), started = gateway.cpu_s(), time.perf_counter()
    results = await asyncio.gather(*(stream_one(session, gateway.url, tokens, i)
                                     for i in range(streams)))
    wall = time.perf_counter() - started
    user_after, system_after = gateway.cpu_s()
    after = asdict(worker.counts)
    sent = {k: after[k] - before[k] for k in after}
    return Burst(streams, tokens, worker.tokens_per_step, sent["tokens"],
                 sum(r.chars for r in results), sum(r.usage_tokens for r in results),
                 sum(r.done for r in results), sent["steps"], sent["stream_steps"],
                 round(wall, 3), round(user_after - user, 3), round(system_after - system, 3))


# -- the run --------------------------------------------------------------------------------

async def run(streams: list[int], tokens: int, tokens_per_step: int, scratch: Path,
              step_ms: float = 0.0, repeats: int = 1, profile_streams: int | None = None,
              warmup: int = 8) -> dict[str, Any]:
    """Every burst (each S, `repeats` times) against one gateway, then the profiled one;
    the gateways' logs and profile go to `scratch`."""
    worker = CostWorker(tokens_per_step, step_ms / 1000)
    servers = {}
    servers["worker"], worker_addr = await _serve(
        "Worker", worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    servers["tokenizer"], tok_addr = await _serve(
        "Tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server, CostTokenizer())
    servers["scheduler"], sched_addr = await _serve(
        "Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server,
        CostScheduler(worker_addr))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    report: dict[str, Any] = {"machine": machine(), "step_ms": step_ms, "bursts": []}
    profile_to = scratch / "gateway.spy"
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            with (scratch / "gateway.log").open("wb") as log:
                report["bursts"] = await _bursts(GatewayProcess(tok_addr, sched_addr, log),
                                                 worker, session, streams, tokens, repeats,
                                                 warmup)
                if profile_streams:
                    report["profile"] = await _profiled(
                        GatewayProcess(tok_addr, sched_addr, log), worker,
                        session, profile_streams, tokens, warmup, profile_to)
    finally:
        for server in servers.values():
            await server.drain(grace_s=0)
    return report


async def _bursts(gateway: GatewayProcess, worker: CostWorker, session: aiohttp.ClientSession,
                  streams: list[int], tokens: int, repeats: int, warmup: int) -> list[dict]:
    try:
        await gateway.ready(session)
        await burst(gateway, worker, session, warmup, tokens)  # first-request costs
        return [asdict(await burst(gateway, worker, session, s, tokens))
                for s in streams for _ in range(repeats)]
    finally:
        gateway.stop()


async def _profiled(gateway: GatewayProcess, worker: CostWorker,
                    session: aiohttp.ClientSession, streams: int, tokens: int, warmup: int,
                    profile_to: Path) -> dict[str, Any]:
    """One burst with py-spy sampling the gateway (attached for that burst only)."""
    try:
        await gateway.ready(session)
        await burst(gateway, worker, session, warmup, tokens)
        spy = _start_py_spy(gateway.process.pid, profile_to)
        try:
            measured = await burst(gateway, worker, session, streams, tokens)
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
            spy.wait(timeout=60)
    finally:
        gateway.stop()
    samples = read_samples(profile_to)
    return {"profiler": f"py-spy at {PROFILE_RATE_HZ} Hz, the burst only, idle excluded",
            "burst": asdict(measured), "samples": sum(samples.values()),
            "self": top_shares(samples, leaf=True), "inclusive": top_shares(samples, leaf=False)}


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling process `pid` into `out` (raw stacks) until it gets SIGINT."""
    return subprocess.Popen([_py_spy(), "record", "--pid", str(pid), "--format", "raw",
                             "--rate", str(PROFILE_RATE_HZ), "--nonblocking", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("--profile-streams needs py-spy (pip install py-spy)")
    return found


def read_samples(path: Path) -> dict[tuple[str, ...], int]:
    """py-spy's raw output: one `frame;frame;...;leaf count` line per distinct stack."""
    samples: dict[tuple[str, ...], int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            key = tuple(stack.split(";"))
            samples[key] = samples.get(key, 0) + int(count)
    return samples


def top_shares(samples: dict[tuple[str, ...], int], leaf: bool,
               count: int = 30) -> list[dict[str, Any]]:
    """The functions by share of the samples: where the stack ends (`leaf`, own time), or
    anywhere in it (inclusive time, a function counted once per stack)."""
    total = sum(samples.values()) or 1
    shares: dict[str, int] = {}
    for stack, hits in samples.items():
        for frame in ({_frame(stack[-1])} if leaf else {_frame(f) for f in stack}):
            shares[frame] = shares.get(frame, 0) + hits
    ranked = sorted(shares.items(), key=lambda kv: kv[1], reverse=True)[:count]
    return [{"function": frame, "share": round(hits / total, 4)} for frame, hits in ranked]


def _frame(frame: str) -> str:
    """`function (path:line)` with the path shortened to its package and the line dropped
    (a function counts as one wherever in it the sample fell)."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    path = path.split("site-packages/", 1)[-1].removeprefix(_REPO)
    return f"{name} ({_STDLIB.sub('', path)})"


def summary(bursts: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stream count, the median of its bursts' cost figures."""
    by_streams: dict[int, list[dict[str, Any]]] = {}
    for row in bursts:
        by_streams.setdefault(row["streams"], []).append(row)
    return {str(streams): {key: statistics.median(r[key] for r in rows)
                           for key in ("us_per_token", "us_per_stream_step", "tokens_per_core_s",
                                       "gateway_core_share")}
            for streams, rows in by_streams.items()}


def machine() -> dict[str, Any]:
    import grpc as grpc_module
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=False).stdout.strip()
    return {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "aiohttp": aiohttp.__version__,
            "grpcio": grpc_module.__version__, "revision": revision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="256,1000", help="concurrent streams per burst")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="the fake engine's step time (0: as fast as the gateway reads)")
    parser.add_argument("--repeats", type=int, default=1, help="bursts per stream count")
    parser.add_argument("--profile-streams", type=int, default=None,
                        help="one more burst of this many streams with py-spy sampling")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-out", type=Path, default=None,
                        help="keep py-spy's raw samples here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = asyncio.run(run([int(s) for s in args.streams.split(",")], args.tokens,
                                 args.tokens_per_step, Path(scratch), args.step_ms,
                                 args.repeats,
                                 args.profile_streams))
        if args.profile_out is not None and args.profile_streams:
            shutil.copy(Path(scratch) / "gateway.spy", args.profile_out)
    report["command"] = " ".join(["python", "loadtest/gateway_cost.py", *sys.argv[1:]])
    report["summary"] = summary(report["bursts"])
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for row in report["bursts"]:
        print(f"S={row['streams']} T={row['tokens_per_stream']}: {row['us_per_token']} us/token "
              f"(user {row['gateway_user_s']} s, sys {row['gateway_sys_s']} s), "
              f"{row['tokens_per_core_s']} tok/core-s, core share {row['gateway_core_share']}, "
              f"{row['worker_steps']} steps, "
              f"read {row['tokens_read']}/{row['tokens_sent']}")
    print("median:", report["summary"])
    for kind in ("self", "inclusive"):
        print(f"-- {kind}")
        for row in report.get("profile", {}).get(kind, [])[:25]:
            print(f"{row['share']:7.2%} {row['function']}")


if __name__ == "__main__":
    main()
