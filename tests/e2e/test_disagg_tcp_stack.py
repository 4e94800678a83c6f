"""Disaggregated serving with the KV handoff over TCP, end to end (CPU, tiny model, no kvstore).

A `meshserve up`-like stack of one prefill and one decode worker with `--kv-handoff tcp` and
no kvstore at all: the prefill worker computes each prompt and its first token and holds
the prompt's KV blocks; the decode worker pulls them from the prefill worker's listener
over parallel TCP streams into blocks it allocated, and continues. A batch of concurrent
greedy requests gives one mixed worker's text, tokens and logprobs (a reference stack, run
first and stopped), and the decode worker's meshserve:kv_handoff_blocks_total{direction=
"received"} counts every prompt block. A second decode worker that keeps its whole cache
free (`--kv-handoff-watermark 1`), started beside them and preferred by the router (more
free blocks), refuses each handed-off request: the gateway moves it to the first decode
worker, and the answers stay the same, with no failover counted.

Logprobs agree to float32 rounding (1e-4), as in test_disagg_stack.py, for the same reasons.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from service_process import free_port, service_process
from test_disagg_stack import assert_same, complete_all, handoff_blocks, metric, worker_metric

from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc

MODEL = "tiny-disagg"  # the name complete_all asks for
BLOCK = 16
MIN_PROMPT_TOKENS = 32
REQUESTS = 24
REFUSED_REQUESTS = 3
STACK_BLOCKS = 1024


@pytest.fixture(scope="module")
def model_dir(disagg_model_dir: Path) -> Path:
    """test_disagg_stack.py's tiny model (tests/e2e/conftest.py)."""
    return disagg_model_dir


def prompts() -> list[list[int]]:
    """Long prompts (2 to 6 full blocks and a partial one), distinct from their first block;
    the last few are sent one at a time to the refusing decode worker."""
    rng = random.Random(33)
    return [[rng.randrange(5, 250) for _ in range(rng.randrange(2 * BLOCK, 6 * BLOCK) + 5)]
            for _ in range(REQUESTS + REFUSED_REQUESTS)]


def launch(model_dir: Path, run_dir: Path, **overrides: Any) -> Iterator[Stack]:
    config = LauncherConfig(**{
        "model": str(model_dir), "served_model_name": MODEL, "port": 0, "kvstore": False,
        "num_kv_blocks": STACK_BLOCKS, "block_size": BLOCK, "dtype": "float32",
        "device": "cpu", "run_dir": str(run_dir), "startup_timeout_s": 300,
        "stop_grace_s": 5, **overrides})
    with start_stack(config) as running:
        yield running


def reference_answers(mixed: Stack) -> list[dict[str, Any]]:
    """What the mixed worker of `mixed` answers to this module's requests."""
    return asyncio.run(complete_all(mixed, prompts()))


@pytest.fixture(scope="module")
def reference(mixed_answers: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What one mixed worker answers (test_disagg_stack.py's reference stack, of the same
    configuration, stopped before either disaggregated one starts: tests/e2e/conftest.py)."""
    return mixed_answers["tcp"]


@pytest.fixture(scope="module")
def stack(model_dir: Path, reference: list[dict[str, Any]],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from launch(model_dir, tmp_path_factory.mktemp("disagg-tcp"), workers=0,
                      prefill_workers=1, decode_workers=1, kv_handoff="tcp",
                      disagg_min_prompt_tokens=MIN_PROMPT_TOKENS)


def test_prefilled_requests_pulled_over_tcp_decode_as_on_one_mixed_worker(
        stack: Stack, reference: list[dict[str, Any]]) -> None:
    batch = prompts()[:REQUESTS]
    answers = asyncio.run(complete_all(stack, batch))
    for i, (got, want) in enumerate(zip(answers, reference, strict=False)):
        assert_same(got, want, f"request {i}")
    # Every prompt's full blocks were held, pulled and found cached on the decode worker.
    full_blocks = sum(len(p) // BLOCK for p in batch)
    assert handoff_blocks(stack, "prefill-0", "sent") == full_blocks
    assert handoff_blocks(stack, "decode-0", "received") == full_blocks
    pulled = worker_metric(stack, "decode-0", "meshserve:kv_handoff_pulled_bytes_total")
    assert pulled > 0
    assert worker_metric(stack, "decode-0", "meshserve:kv_handoff_failed_pulls_total") == 0
    # Pulled blocks were freed on the prefill worker at once.
    assert worker_metric(stack, "prefill-0", "meshserve:kv_handoff_held_bytes") == 0
    generated = "meshserve:worker_generated_tokens_total"
    assert worker_metric(stack, "prefill-0", generated) == REQUESTS
    gateway = next(s for s in stack.services if s.role == "gateway")
    assert metric(gateway.metrics_url, "meshserve:gateway_failovers_total",
                  '{outcome="resumed"}') == 0


def registered_free_blocks(stack: Stack, worker_id: str) -> int:
    """The free blocks the scheduler last heard from `worker_id` (-1: not registered)."""
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5.0)
    loads = {w.info.worker_id: int(w.load.num_free_blocks) for w in listed.workers}
    return loads.get(worker_id, -1)


def test_a_decode_worker_without_room_refuses_and_the_request_completes_elsewhere(
        stack: Stack, model_dir: Path, reference: list[dict[str, Any]]) -> None:
    metrics_port = free_port()
    args = ["--host", "127.0.0.1", "--model", str(model_dir), "--served-model-names", MODEL,
            "--worker-id", "decode-full", "--role", "decode", "--redis-url", stack.redis_url,
            "--scheduler-address", stack.scheduler_address, "--kv-handoff", "tcp",
            "--kv-handoff-watermark", "1", "--num-kv-blocks", str(2 * STACK_BLOCKS),
            "--block-size", str(BLOCK), "--dtype", "float32", "--device", "cpu",
            "--metrics-port", str(metrics_port)]
    full_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    refusals = "meshserve:kv_handoff_refusals_total"
    with service_process("worker", args, "meshserve.v1.Worker"):
        deadline = time.monotonic() + 60
        # The router prefers it once it has heard its load (more free blocks than decode-0).
        while registered_free_blocks(stack, "decode-full") <= STACK_BLOCKS:
            assert time.monotonic() < deadline, "decode-full never reported its load"
            time.sleep(0.1)  # polling the registry: a heartbeat sends no other signal
        received = handoff_blocks(stack, "decode-0", "received")
        for i in range(REQUESTS, REQUESTS + REFUSED_REQUESTS):  # one by one: idle loads
            (answer,) = asyncio.run(complete_all(stack, [prompts()[i]]))
            assert_same(answer, reference[i], f"request {i} (refused by decode-full)")
        assert metric(full_metrics, refusals) == REFUSED_REQUESTS
        assert metric(full_metrics, "meshserve:worker_generated_tokens_total") == 0
    # Each went on to decode-0, its blocks pulled from the prefill worker all the same.
    moved = sum(len(p) // BLOCK for p in prompts()[REQUESTS:])
    assert handoff_blocks(stack, "decode-0", "received") == received + moved
    gateway = next(s for s in stack.services if s.role == "gateway")
    assert metric(gateway.metrics_url, "meshserve:gateway_failovers_total",
                  '{outcome="resumed"}') == 0
