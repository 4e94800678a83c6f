"""The fault matrix: `kill -9` each part of a running mesh under streaming load.

Driver part: `kv` (KV_PARTS=failover); also the e2e and contract tests.

    python loadtest/fault_matrix.py [--model PATH] [--streams 20] [--max-tokens 96] \
        [--parts worker,tokenizer,scheduler,kvstore,redis] --out results.json

For each part in turn, on one `meshserve up` stack with two workers (`start_stack`):
N streaming `/v1/completions` run (greedy, `ignore_eos`); once every stream has sent a few
chunks (for a worker: once the workers' own loads show every stream generating, read off
the client's event loop, which lags behind them), the part's process gets SIGKILL. Then it
records how each stream ended (its own `finish_reason` and `[DONE]`; an error event and
`[DONE]`; cut without `[DONE]`; hung past its timeout), how long until a new request
succeeded again, and how long until the killed part was back (restarted by the launcher:
SERVING on its address, or registered again for a worker, or answering PING for Redis). For
a worker, the streams it ran fail over to the other one: `resume_s` holds, for each of them,
the time from the kill to its first token after the move (measured by the client; see
`_resume_times`). For the tokenizer, the streams' detokenization waits for the restarted
replica and goes on there, so they complete too. The stack is checked to be still up at the
end of each drill.
`tests/e2e/test_fault_matrix.py` runs the same drill on a tiny model in CI and asserts
the outcomes; this script records them on a real model (loadtest/reports/).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from meshserve.bench.serve.client import sse_events
from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

PARTS = ("worker", "tokenizer", "scheduler", "kvstore", "redis")
_PROBE_INTERVAL_S = 0.1
_LOAD_POLL_S = 0.02  # a tiny model's stream lasts about a second: poll well within it


@dataclasses.dataclass
class StreamEnd:
    """How one client stream ended."""

    chunks: int = 0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # time.monotonic()
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False  # `data: [DONE]` arrived
    failure: str | None = None  # transport failure, HTTP status or timeout

    @property
    def outcome(self) -> str:
        if self.failure is not None:
            return "hung" if self.failure == "timeout" else "cut"
        if not self.done:
            return "cut"
        return "error" if self.error is not None else "completed"


@dataclasses.dataclass
class DrillResult:
    """One part's drill: stream outcomes and recovery times (seconds after the kill)."""

    part: str
    service: str
    streams: int
    completed: int
    errored: int
    cut: int
    hung: int
    running_on_killed_worker: int | None
    # Worker drill: kill to the first token after the move, per stream moved (slowest last).
    resume_s: list[float] | None
    next_chunk_s: list[float] | None
    """Every stream's first chunk after the kill, in seconds, sorted (inf: none came): the
    surviving worker's streams show whether the kill (or the restart) stalled it too."""
    first_success_s: float | None
    part_back_s: float | None
    stack_up: bool
    errors: list[str]


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  end: StreamEnd, started: Callable[[], None], timeout_s: float) -> None:
    """One SSE stream; fills `end`; calls `started` once its third chunk arrived."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    end.failure = f"HTTP {response.status}"
                    return
                async for data in sse_events(response):
                    if data == b"[DONE]":
                        end.done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        end.error = event["error"]
                        continue
                    end.chunks += 1
                    end.chunk_times.append(time.monotonic())
                    if end.chunks == 3:
                        started()
                    reason = event["choices"][0].get("finish_reason")
                    end.finish_reason = reason or end.finish_reason
    except TimeoutError:
        end.failure = "timeout"
    except aiohttp.ClientError as exc:
        end.failure = f"{type(exc).__name__}: {exc}"


async def _one_request(session: aiohttp.ClientSession, url: str, model: str) -> bool:
    """A short non-streaming completion; True on 200."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    try:
        async with asyncio.timeout(5.0):
            async with session.post(url, json=body) as response:
                await response.read()
                return response.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


def _kill_once_generating(addresses: list[str], streams: int, finished: Callable[[], int],
                          preferred: int, kill: Callable[[int], None],
                          give_up: threading.Event) -> tuple[list[int], float, int]:
    """Poll the workers' own loads until every stream has started (those running plus those
    the client saw finish make `streams`), none waits, no prompt token is left to compute and
    a worker runs some, then `kill` one at once: worker `preferred` when it still runs
    streams, else the one running most (on a slow machine one worker's streams can all end
    before the other's last one is admitted). Each worker's running count then, the time of
    the kill and the killed worker's index; RuntimeError once `give_up` is set.

    Counting the finished ones lets the kill come when admissions straggle: on a loaded
    machine the first streams can end before the last one is admitted, so all of them never
    run at once.

    The worker drill kills on this, in a thread of its own, rather than on the client's
    chunks: the client's event loop reads behind the workers, on a loaded 2-core machine by
    a second or more (a tiny model's 400 tokens had all gone by on one worker when the last
    stream showed its third chunk), and the killed worker's streams must still be running
    at the kill. Requests left over from an earlier drill keep the sum off `streams`, so
    the kill waits for them to end.
    """
    channels = [grpc.insecure_channel(address) for address in addresses]
    stubs = [worker_pb2_grpc.WorkerStub(channel) for channel in channels]
    loads: list[Any] = []
    try:
        while not give_up.is_set():
            loads = [stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2.0).load
                     for stub in stubs]
            running = [int(load.num_running) for load in loads]
            if (sum(running) + finished() == streams and any(running)
                    and not any(load.num_waiting or load.num_pending_prefill_tokens
                                for load in loads)):
                target = preferred if running[preferred] else running.index(max(running))
                killed_at = time.monotonic()
                kill(target)
                return running, killed_at, target
            give_up.wait(_LOAD_POLL_S)  # polling: a worker's load sends no signal
    finally:
        for channel in channels:
            channel.close()
    raise RuntimeError(
        f"the workers never showed all {streams} streams started ({finished()} finished); "
        f"last seen (running, waiting, prompt tokens to compute): "
        f"{[(x.num_running, x.num_waiting, x.num_pending_prefill_tokens) for x in loads]}")


def _running_per_worker(stack: Stack) -> dict[str, tuple[int, int]]:
    """worker id -> (running requests, epoch), as the scheduler sees them."""
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=2.0)
    return {w.info.worker_id: (w.load.num_running, w.info.epoch) for w in listed.workers}


async def _every_worker_listed(stack: Stack, timeout_s: float) -> None:
    """Until the scheduler lists every worker of the stack (after an earlier drill, workers
    register again with a restarted scheduler within their retry backoff)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if set(_running_per_worker(stack)) >= set(stack.worker_ids):
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every worker registered within {timeout_s}s")
        await asyncio.sleep(0.1)  # polling the registry: registration sends no signal here


def _resume_times(ends: list[StreamEnd], killed_at: float, moved: int) -> list[float]:
    """Seconds from the kill to the first chunk after it, of the `moved` streams that waited
    longest for it: those the killed worker ran.

    A stream on the surviving worker gets its next token from the step running at the
    kill, or the one after it, while a moved stream can only be in a step that starts after
    the gateway saw the loss and re-added it there: the moved streams come last (or tie).
    """
    # A stream whose every chunk came before the kill had finished: it neither moved nor
    # resumed (the registry read before the kill can be slower than a short stream).
    unfinished = [end for end in ends if not end.chunk_times or end.chunk_times[-1] > killed_at]
    after = sorted(next((t - killed_at for t in end.chunk_times if t > killed_at),
                        math.inf) for end in unfinished)
    moved = min(moved, len(after))
    return [round(t, 4) for t in after[len(after) - moved:]] if moved else []


def _service_for(stack: Stack, part: str) -> str:
    return {"worker": stack.worker_ids[0], "tokenizer": "tokenizer-0"}.get(part, part)


def _part_back(stack: Stack, part: str, service: str, epoch: int | None) -> bool:
    """Whether the killed part was restarted and is healthy (registered, for a worker)."""
    if part == "worker":
        try:
            workers = _running_per_worker(stack)
        except grpc.RpcError:
            return False
        return service in workers and workers[service][1] != epoch
    return stack.service_healthy(service)


async def _kill_under_load(stack: Stack, part: str, service: str, ends: list[StreamEnd],
                           tasks: list[asyncio.Future[Any]], all_started: asyncio.Event,
                           timeout_s: float) -> tuple[int | None, float, str]:
    """Kill `service` once its streams run: for a worker, when the workers' loads show every
    stream generating (`_kill_once_generating`, off this loop, which may pick the other
    worker); for another part, when every stream has sent chunks. The killed worker's
    running count (None for other parts), the time of the kill and the service killed;
    RuntimeError when the streams end (or time out) first."""
    give_up = threading.Event()
    ready: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(
        _kill_once_generating, stack.worker_addresses, len(ends),
        lambda: sum(end.done or end.failure is not None for end in ends),
        stack.worker_ids.index(service) if part == "worker" else 0,
        lambda target: stack.kill(stack.worker_ids[target], signal.SIGKILL), give_up)
        if part == "worker" else all_started.wait())
    every_stream = asyncio.ensure_future(asyncio.wait(tasks))
    await asyncio.wait([ready, every_stream], return_when=asyncio.FIRST_COMPLETED,
                       timeout=timeout_s)
    if not ready.done():  # every stream ended (or the wait timed out) first
        give_up.set()  # ends the worker drill's poll, which tells what it saw last
        if part != "worker":
            ready.cancel()
        await asyncio.gather(*tasks)
        poll = (await asyncio.gather(ready, return_exceptions=True))[0] \
            if part == "worker" else None
        raise RuntimeError(f"not every stream started before the kill: "
                           f"{[e.failure or e.outcome for e in ends]}"
                           + (f" ({poll})" if poll else ""))
    every_stream.cancel()  # only the wait: the streams go on
    if part == "worker":
        per_worker, killed_at, target = ready.result()
        return per_worker[target], killed_at, stack.worker_ids[target]
    killed_at = time.monotonic()
    stack.kill(service, signal.SIGKILL)
    return None, killed_at, service


async def _recovery(session: aiohttp.ClientSession, url: str, model: str, stack: Stack,
                    part: str, service: str, epoch: int | None, killed_at: float,
                    timeout_s: float) -> tuple[float | None, float | None]:
    """Seconds from the kill until a new request succeeded, and until the part was back."""
    first_success = part_back = None
    deadline = killed_at + timeout_s
    while time.monotonic() < deadline and (first_success is None or part_back is None):
        if first_success is None and await _one_request(session, url, model):
            first_success = time.monotonic() - killed_at
        if part_back is None and await asyncio.to_thread(_part_back, stack, part, service,
                                                         epoch):
            part_back = time.monotonic() - killed_at
        await asyncio.sleep(_PROBE_INTERVAL_S)
    return first_success, part_back


async def drill(stack: Stack, part: str, model: str, *, streams: int = 20,
                max_tokens: int = 96, stream_timeout_s: float = 120.0,
                recover_timeout_s: float = 60.0, prompt: str = "Tell me a story.",
                token_prompt: list[int] | None = None) -> DrillResult:
    """Kill `part` of `stack` under `streams` streams; return how the mesh took it."""
    assert part in PARTS, f"part must be one of {PARTS}: {part!r}"
    service = _service_for(stack, part)
    url = f"{stack.base_url}/completions"
    headers = {"Authorization": f"Bearer {stack.config.api_key}"} if stack.config.api_key else {}

    def body(i: int) -> dict[str, Any]:
        # Prompts differ from their first token, from each other and from other drills', so
        # that no cached prefix draws them to one worker.
        text: Any = [*token_prompt[i % len(token_prompt):], *token_prompt] if token_prompt \
            else f"{i} ({part}): {prompt}"
        return {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}

    await _every_worker_listed(stack, recover_timeout_s)
    # The workers' lives now, so that no read stands between their loads and the kill.
    epochs = {wid: epoch for wid, (_, epoch) in _running_per_worker(stack).items()}
    ends = [StreamEnd() for _ in range(streams)]
    all_started = asyncio.Event()
    count = 0

    def started() -> None:
        nonlocal count
        count += 1
        if count == streams:
            all_started.set()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        tasks = [asyncio.ensure_future(_stream(session, url, body(i), end, started,
                                               stream_timeout_s)) for i, end in enumerate(ends)]
        running, killed_at, service = await _kill_under_load(stack, part, service, ends, tasks,
                                                             all_started, stream_timeout_s)
        first_success, part_back = await _recovery(session, url, model, stack, part, service,
                                                   epochs.get(service) if part == "worker"
                                                   else None, killed_at, recover_timeout_s)
        await asyncio.gather(*tasks)
    outcomes = [end.outcome for end in ends]
    resume = None if running is None else _resume_times(ends, killed_at, running)
    every = _resume_times(ends, killed_at, len(ends)) if part == "worker" else None
    return DrillResult(
        part=part, service=service, streams=streams, completed=outcomes.count("completed"),
        errored=outcomes.count("error"), cut=outcomes.count("cut"), hung=outcomes.count("hung"),
        running_on_killed_worker=running, resume_s=resume, next_chunk_s=every,
        first_success_s=first_success,
        part_back_s=part_back, stack_up=stack.running(),
        errors=sorted({str((e.error or {}).get("message") or e.failure) for e in ends
                       if e.error is not None or e.failure is not None}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="model (default: SmolLM2-135M-Instruct, the default model)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="of the GPU, split between the two workers when they share one")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="keep the services' logs there (default: a temporary folder)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = LauncherConfig(model=args.model, served_model_name="model", workers=2, port=0,
                            device=args.device, dtype=args.dtype, load_format=args.load_format,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            max_model_len=args.max_model_len, startup_timeout_s=600,
                            stop_grace_s=10,
                            run_dir=None if args.run_dir is None else str(args.run_dir))
    results = []
    with start_stack(config, say=lambda line: print(line, file=sys.stderr, flush=True)) as stack:
        for part in args.parts.split(","):
            result = asyncio.run(drill(stack, part, "model", streams=args.streams,
                                       max_tokens=args.max_tokens))
            print(json.dumps(dataclasses.asdict(result)), flush=True)
            results.append(dataclasses.asdict(result))
    args.out.write_text(json.dumps({"model": args.model or "SmolLM2-135M-Instruct (default)",
                                    "device": args.device,
                                    "cpu_count": os.cpu_count(), "streams": args.streams,
                                    "max_tokens": args.max_tokens, "results": results},
                                   indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
