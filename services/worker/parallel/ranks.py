"""Starting the ranks of a tensor-parallel worker and watching them.

Rank 0 is the worker process itself. It starts ranks 1..N-1 as child processes
(`python -m meshserve.services.worker.follower`), hands each its `RankSpec` on
stdin and keeps that pipe open for the follower's life: a follower exits as soon as the
pipe reaches EOF, which happens when rank 0 exits, is killed or stops the group, so no
rank outlives the worker. A follower that fails is fatal for the worker: a watcher thread
logs which rank failed and ends rank 0 (collectives with a dead rank never complete).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.parallel.broadcast import StepSync
from meshserve.services.worker.parallel.config import ParallelConfig

log = logging.getLogger(__name__)

FOLLOWER_MODULE = "meshserve.services.worker.follower"
# Collectives of the model (and joining the group) fail after this long.
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# The followers wait for rank 0's next step for as long as the worker is idle.
_IDLE_TIMEOUT = timedelta(days=3650)
_STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class RankSpec:
    """What a follower needs to join: sent pickled on its stdin."""

    config: EngineConfig
    rank: int
    world_size: int
    port: int
    num_threads: int


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(parallel: ParallelConfig, device: torch.device, port: int) -> StepSync:
    """Join the ranks' process group (blocks until all have joined); the step hand-off."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=parallel.rank, world_size=parallel.world_size,
                            timeout=_COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        # NCCL connects lazily, at the first collective: make that one now, never inside a
        # CUDA graph capture.
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    # Steps are handed over host to host, with no timeout: an idle worker sends none.
    return StepSync(dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_worker(rank: int, code: int) -> None:
    log.critical("tensor-parallel rank %d exited with code %d (its log is above); the worker "
                 "cannot run without it and exits", rank, code)
    os._exit(1)


class RankGroup:
    """Rank 0's handle on ranks 1..N-1: their processes and the step hand-off."""

    def __init__(self, processes: list[subprocess.Popen[bytes]], sync: StepSync,
                 on_failure: Callable[[int, int], None]) -> None:
        self.processes = processes
        self.sync = sync
        self.on_failure = on_failure
        self._stopping = False
        for rank, process in enumerate(processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), daemon=True,
                             name=f"tp-rank-{rank}-watch").start()

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device,
              on_failure: Callable[[int, int], None] = _exit_worker) -> RankGroup:
        """Start ranks 1..N-1 and join the group with them as rank 0."""
        world = config.tensor_parallel_size
        port = _free_port()
        processes = []
        for rank in range(1, world):
            process = subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE],
                                       stdin=subprocess.PIPE)
            assert process.stdin is not None
            pickle.dump(RankSpec(config, rank, world, port, torch.get_num_threads()),
                        process.stdin)
            process.stdin.flush()
            processes.append(process)
        log.info("started tensor-parallel ranks 1..%d (pids %s)", world - 1,
                 [p.pid for p in processes])
        sync = join_group(ParallelConfig(world_size=world, rank=0), device, port)
        return cls(processes, sync, on_failure)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self) -> None:
        """End the followers (closing their pipes) and leave the group."""
        self._stopping = True
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank pid %d did not exit; killing it", process.pid)
                process.kill()
                process.wait()
        # A gloo group is left so that another engine of this process can form one. NCCL's
        # is not: destroying it can hang after graphs captured its collectives (PyTorch
        # issue 115388), and a process runs one NCCL engine until it exits.
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        if not self._stopping:
            self.on_failure(rank, code)
