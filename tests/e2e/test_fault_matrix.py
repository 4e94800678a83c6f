"""`kill -9` each part of a running mesh under 20 streams (loadtest/fault_matrix.py's drill).

One `meshserve up` stack (start_stack) with two workers on a tiny model; for each of the
kvstore, scheduler, Redis, tokenizer and a worker in turn: no stream ends without `[DONE]`
or hangs, streams on parts that stayed up complete (a killed worker's streams fail over, and
a killed tokenizer's wait for its restart, and complete too), the stack serves new requests again within 10 s with the killed part
restarted and back (registered again, for a worker), and the stack is still up.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from loadtest_scripts import load_script
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

MODEL = "tiny"
STREAMS = 20
RECOVERY_S = 10.0


fault_matrix = load_script("fault_matrix")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("fault-model"), "llama", seed=7,
                                 max_position_embeddings=4096)
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=2, port=0,
                            num_kv_blocks=512, dtype="float32", device="cpu",
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=5)
    with start_stack(config) as running:
        yield running


def _drill(stack: Stack, part: str):
    return asyncio.run(fault_matrix.drill(stack, part, MODEL, streams=STREAMS, max_tokens=400,
                                          recover_timeout_s=30.0))


def _assert_recovered(stack: Stack, result) -> None:
    assert (result.cut, result.hung) == (0, 0), result
    assert result.first_success_s is not None and result.first_success_s <= RECOVERY_S, result
    assert result.part_back_s is not None and result.part_back_s <= RECOVERY_S, result
    assert result.stack_up, result
    # The launcher restarted it once, and says so on its own /metrics.
    assert stack.restarts(result.service) == 1
    metrics = urllib.request.urlopen(stack.launcher_metrics_url, timeout=5).read().decode()
    assert re.search(rf'meshserve:launcher_service_restarts_total{{[^}}]*service="'
                     rf'{result.service}"[^}}]*}} 1\.0', metrics), metrics


@pytest.mark.parametrize("part", ["kvstore", "scheduler", "redis"])
def test_streams_outlive_a_part_they_no_longer_need(stack: Stack, part: str) -> None:
    result = _drill(stack, part)
    # Placed streams need none of these parts: every one finishes on its own.
    assert result.completed == STREAMS, result
    _assert_recovered(stack, result)


def test_streams_outlive_the_tokenizer(stack: Stack) -> None:
    result = _drill(stack, "tokenizer")
    # Their detokenization waits for the restarted tokenizer and goes on there: every stream
    # completes, none with an error (tests/e2e/test_detokenize_failover.py checks the text).
    assert (result.completed, result.errored) == (STREAMS, 0), result
    _assert_recovered(stack, result)


def test_the_dead_workers_streams_fail_over_and_complete(stack: Stack) -> None:
    result = _drill(stack, "worker")
    running = result.running_on_killed_worker
    assert running is not None
    assert 0 < running < STREAMS, result  # both workers had streams
    # Those on the dead worker move to the other one and complete there, like the rest.
    assert result.completed == STREAMS, result
    # Each of them that was still streaming at the kill (on a loaded machine a few may have
    # finished between the load read and the kill) resumed on the other worker.
    assert result.resume_s and len(result.resume_s) <= running, result
    assert all(0 < t <= RECOVERY_S for t in result.resume_s), result
    _assert_recovered(stack, result)
