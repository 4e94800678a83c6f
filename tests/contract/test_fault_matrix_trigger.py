"""When the fault drill kills a worker: once the workers' own loads show every stream
generating or finished (loadtest/fault_matrix.py), read from real grpc.aio servers on
127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from loadtest_scripts import load_script

from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc

fault_matrix = load_script("fault_matrix")

Load = tuple[int, int, int]  # running, waiting, prompt tokens to compute


class ScriptedLoads(worker_pb2_grpc.WorkerServicer):
    """GetLoad answers `loads` in turn, then the last one for ever."""

    def __init__(self, *loads: Load) -> None:
        self.loads = list(loads)
        self.calls = 0

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetLoadResponse:
        running, waiting, pending = self.loads[min(self.calls, len(self.loads) - 1)]
        self.calls += 1
        return worker_pb2.GetLoadResponse(load=common_pb2.WorkerLoad(
            num_running=running, num_waiting=waiting, num_pending_prefill_tokens=pending))


@pytest.fixture
async def serve() -> AsyncIterator[object]:
    servers: list[grpc.aio.Server] = []

    async def start(servicer: ScriptedLoads) -> str:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(grace=None)


async def test_the_worker_is_killed_once_every_stream_is_generating(serve) -> None:
    # Worker 0 queues two, then computes its prompts; worker 1 has its five at once.
    first = ScriptedLoads((3, 2, 0), (5, 0, 40), (5, 0, 0))
    second = ScriptedLoads((5, 0, 0))
    addresses = [await serve(first), await serve(second)]
    kills: list[tuple[int, int]] = []  # GetLoad calls each worker had answered at the kill
    running, killed_at, target = await asyncio.to_thread(
        fault_matrix._kill_once_generating, addresses, 10, lambda: 0, 0,
        lambda killed: kills.append((first.calls, second.calls)), threading.Event())
    assert (running, kills, target) == ([5, 5], [(3, 3)], 0)
    assert killed_at <= time.monotonic()


async def test_requests_left_over_from_an_earlier_drill_hold_the_kill_back(serve) -> None:
    addresses = [await serve(ScriptedLoads((6, 0, 0))), await serve(ScriptedLoads((5, 0, 0)))]
    give_up = threading.Event()
    kills: list[None] = []
    poll = asyncio.ensure_future(asyncio.to_thread(
        fault_matrix._kill_once_generating, addresses, 10, lambda: 0, 0,
        lambda killed: kills.append(None), give_up))
    done, _ = await asyncio.wait([poll], timeout=0.3)
    assert not done  # still polling: 11 requests for 10 streams
    give_up.set()
    with pytest.raises(RuntimeError, match=r"never showed all 10 streams started \(0 finished\); "
                       r"last seen .*: \[\(6, 0, 0\), \(5, 0, 0\)\]"):
        await poll
    assert kills == []


async def test_streams_that_finished_before_the_last_one_started_count_as_started(
        serve) -> None:
    # Four of ten ended before the last was admitted: the other six never ran beside them.
    first = ScriptedLoads((2, 1, 0), (3, 0, 0))
    second = ScriptedLoads((3, 0, 0))
    addresses = [await serve(first), await serve(second)]
    finished = [4]
    kills: list[int] = []
    running, _, target = await asyncio.to_thread(
        fault_matrix._kill_once_generating, addresses, 10, lambda: finished[0], 1,
        lambda killed: kills.append(first.calls), threading.Event())
    assert (running, kills, target) == ([3, 3], [2], 1)


async def test_the_other_worker_is_killed_when_the_preferred_one_runs_nothing(serve) -> None:
    # Worker 1's streams all ended before worker 0's last one was admitted (a slow machine):
    # the kill goes to worker 0, which still runs streams, rather than never coming.
    addresses = [await serve(ScriptedLoads((3, 1, 0), (4, 0, 0))),
                 await serve(ScriptedLoads((0, 0, 0)))]
    kills: list[int] = []
    running, _, target = await asyncio.to_thread(
        fault_matrix._kill_once_generating, addresses, 10, lambda: 6, 1, kills.append,
        threading.Event())
    assert (running, kills, target) == ([4, 0], [0], 0)
