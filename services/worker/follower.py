"""A follower rank (1..N-1) of a tensor-parallel worker: `python -m` this module.

It reads its `RankSpec` from stdin, builds the same engine as rank 0 (its slice of the
model, the same KV cache and CUDA graphs: every collective of the start-up runs in the
same order on every rank), then runs each step rank 0 hands it: forward pass and logits,
taking part in the collectives; rank 0 alone samples. It exits when its stdin reaches EOF
(rank 0 stopped or died) and, on any error, with a traceback and a non-zero code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading

import torch

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.engine.device import resolve_device
from meshserve.services.worker.heap import settle_heap
from meshserve.services.worker.parallel.config import ParallelConfig
from meshserve.services.worker.parallel.ranks import RankSpec, join_group

log = logging.getLogger("meshserve.services.worker.follower")


def _exit_when_rank0_leaves() -> None:
    sys.stdin.buffer.read()  # returns at EOF: rank 0 closed the pipe or is gone
    os._exit(0)


def run(spec: RankSpec) -> None:
    """Join, build the engine and follow rank 0's steps until told to stop."""
    torch.set_num_threads(spec.num_threads)
    parallel = ParallelConfig(world_size=spec.world_size, rank=spec.rank,
                              custom_all_reduce=not spec.config.disable_custom_all_reduce,
                              fused_norm=spec.config.tp_fused_norm,
                              expert_parallel=spec.config.enable_expert_parallel)
    device = resolve_device(spec.config.device, spec.rank)
    sync = join_group(parallel, device, spec.port)
    # Grammars are compiled and applied by rank 0 only.
    config = dataclasses.replace(spec.config, structured_outputs_backend="none")
    engine = build_engine(config, parallel=parallel, sync=sync)
    settle_heap(engine)
    log.info("tensor-parallel rank %d of %d ready on %s", spec.rank, spec.world_size, device)
    while (plan := sync.receive()) is not None:
        engine.follow(plan)


def main() -> int:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_when_rank0_leaves, daemon=True, name="rank0-watch").start()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(name)s: "
                               "%(message)s")
    try:
        run(spec)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    # Not sys.exit: interpreter shutdown would wait on the stdin watcher's blocked read.
    os._exit(code)
