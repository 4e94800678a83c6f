"""Disaggregated prefill/decode serving end to end (CPU, tiny model, the real `openai` client).

A `meshserve up`-like stack of one prefill and one decode worker with the kvstore: a long
prompt is computed on the prefill worker, which samples the first token and hands the
prompt's KV blocks off through the kvstore; the decode worker loads them as prefix hits and
continues the stream. Fifty concurrent greedy requests give the same text, tokens and
logprobs as one mixed worker (a reference stack, run first and stopped), and the workers'
meshserve:kv_handoff_blocks_total counters show the blocks sent and received. A prompt
shorter than --disagg-min-prompt-tokens runs whole on the decode worker. `kill -9` of the
prefill worker (stopped first, so that it holds 20 requests not yet started) or of the
decode worker (while it decodes 20 longer requests): each still completes with the mixed
worker's answer (retried whole on the decode worker, or failed over to the prefill worker).
With the kvstore stopped, nothing is handed off: the decode worker recomputes the prompts,
with the same answers.

Logprobs agree to float32 rounding (1e-4), not bit for bit: concurrent prompts are batched
differently on the two stacks, and the decode worker recomputes the prompt's partial last
block and the first token in a step shaped unlike the mixed worker's prefill, so their KV
differ in the last bits (as after any prefix-cache hit).
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

MODEL = "tiny-disagg"
BLOCK = 16
MIN_PROMPT_TOKENS = 32
REQUESTS = 50
MAX_TOKENS = 6
# How long the prefill worker waits for a prompt's blocks to reach the kvstore: the stopped
# store's five requests each wait this long before handing off none (the default is 10 s).
SEND_TIMEOUT_S = 3.0
FAULT_REQUESTS = 20
FAULT_MAX_TOKENS = 40  # long enough that requests still run when a worker is killed
BACK_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model_dir(disagg_model_dir: Path) -> Path:
    """The tiny model, shared with test_disagg_tcp_stack.py (tests/e2e/conftest.py)."""
    return disagg_model_dir


def prompts() -> list[list[int]]:
    """Long prompts (2 to 6 full blocks and a partial one), distinct from their first block."""
    rng = random.Random(32)
    return [[rng.randrange(5, 250) for _ in range(rng.randrange(2 * BLOCK, 6 * BLOCK) + 3)]
            for _ in range(REQUESTS)]


def fault_prompts() -> list[list[int]]:
    """The first prompts again with one token changed (no prefix hits from earlier tests)."""
    return [[3, *p[1:]] for p in prompts()[:FAULT_REQUESTS]]


def storeless_prompts() -> list[list[int]]:
    """Five more prompts, for the test without a kvstore."""
    return [[4, *p[1:]] for p in prompts()[:5]]


SHORT_PROMPT = [17, 23, 42, 99, 7, 8, 120, 33, 61, 5]  # under MIN_PROMPT_TOKENS


# Room for all fifty requests at once on the decode worker: one that finds no room is run
# whole by its prefill worker (the router's choice), which this test does not want.
def launch(model_dir: Path, run_dir: Path, **overrides: Any) -> Iterator[Stack]:
    config = LauncherConfig(**{
        "model": str(model_dir), "served_model_name": MODEL, "port": 0,
        "num_kv_blocks": 1024, "block_size": BLOCK, "dtype": "float32", "device": "cpu",
        "run_dir": str(run_dir), "startup_timeout_s": 300, "stop_grace_s": 5, **overrides})
    with start_stack(config) as running:
        yield running


async def complete_all(stack: Stack, batch: list[list[int]], max_tokens: int = MAX_TOKENS
                       ) -> list[dict[str, Any]]:
    """Greedy completions of every prompt at once: text, token logprobs, top logprobs."""
    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none",
                                max_retries=0, timeout=240)

    async def one(prompt: list[int]) -> dict[str, Any]:
        response = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2,
            extra_body={"ignore_eos": True})
        choice = response.choices[0]
        assert choice.finish_reason == "length"
        assert response.usage is not None and response.usage.completion_tokens == max_tokens
        assert choice.logprobs is not None
        return {"text": choice.text, "tokens": choice.logprobs.tokens,
                "token_logprobs": choice.logprobs.token_logprobs,
                "top_logprobs": choice.logprobs.top_logprobs}

    try:
        return list(await asyncio.gather(*(one(p) for p in batch)))
    finally:
        await client.close()


def reference_answers(mixed: Stack) -> list[dict[str, Any]]:
    """What the mixed worker of `mixed` answers to this module's requests."""
    answers = asyncio.run(complete_all(mixed, [*prompts(), SHORT_PROMPT]))
    answers += asyncio.run(complete_all(mixed, fault_prompts(), FAULT_MAX_TOKENS))
    return answers + asyncio.run(complete_all(mixed, storeless_prompts()))


@pytest.fixture(scope="module")
def reference(mixed_answers: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What one mixed worker answers (a reference stack shared with test_disagg_tcp_stack.py,
    stopped before the disaggregated one starts: tests/e2e/conftest.py)."""
    return mixed_answers["store"]


@pytest.fixture(scope="module")
def stack(model_dir: Path, reference: list[dict[str, Any]],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from launch(model_dir, tmp_path_factory.mktemp("disagg"), workers=0,
                      prefill_workers=1, decode_workers=1,
                      disagg_min_prompt_tokens=MIN_PROMPT_TOKENS,
                      kv_handoff_send_timeout_s=SEND_TIMEOUT_S)


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Same text and tokens; logprobs equal to float32 rounding."""
    assert got["text"] == want["text"] and got["tokens"] == want["tokens"], what
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4), what
    for top, wanted in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert list(top) == list(wanted), what
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=1e-4), what


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample's value on a Prometheus endpoint (0 when absent)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def worker_metric(stack: Stack, worker: str, name: str, labels: str = "") -> float:
    (service,) = [s for s in stack.services if s.name == worker]
    return metric(service.metrics_url, name, labels)


def handoff_blocks(stack: Stack, worker: str, direction: str) -> float:
    return worker_metric(stack, worker, "meshserve:kv_handoff_blocks_total",
                         f'{{direction="{direction}"}}')


def test_fifty_prefilled_requests_decode_as_on_one_mixed_worker(
        stack: Stack, reference: list[dict[str, Any]]) -> None:
    batch = prompts()
    answers = asyncio.run(complete_all(stack, batch))
    for i, (got, want) in enumerate(zip(answers, reference, strict=False)):
        assert_same(got, want, f"request {i}")
    # Every prompt's full blocks went through the handoff (one request each, all distinct).
    full_blocks = sum(len(p) // BLOCK for p in batch)
    assert handoff_blocks(stack, "prefill-0", "sent") == full_blocks
    received = handoff_blocks(stack, "decode-0", "received")
    assert 0 < received <= full_blocks
    assert worker_metric(stack, "decode-0", "meshserve:worker_kvstore_loaded_blocks_total") \
        >= received
    # The prefill worker sampled one token per request; the decode worker the rest.
    generated = "meshserve:worker_generated_tokens_total"
    assert worker_metric(stack, "prefill-0", generated) == REQUESTS
    assert worker_metric(stack, "decode-0", generated) == REQUESTS * (MAX_TOKENS - 1)
    # A handoff is no failover.
    gateway = next(s for s in stack.services if s.role == "gateway")
    assert metric(gateway.metrics_url, "meshserve:gateway_failovers_total",
                  '{outcome="resumed"}') == 0


def test_a_short_prompt_runs_whole_on_the_decode_worker(
        stack: Stack, reference: list[dict[str, Any]]) -> None:
    generated = "meshserve:worker_generated_tokens_total"
    before = {w: worker_metric(stack, w, generated) for w in ("prefill-0", "decode-0")}
    sent = handoff_blocks(stack, "prefill-0", "sent")
    (answer,) = asyncio.run(complete_all(stack, [SHORT_PROMPT]))
    assert_same(answer, reference[REQUESTS], "the short prompt")
    assert worker_metric(stack, "prefill-0", generated) == before["prefill-0"]
    assert worker_metric(stack, "decode-0", generated) == before["decode-0"] + MAX_TOKENS
    assert handoff_blocks(stack, "prefill-0", "sent") == sent


def running_on(address: str) -> int:
    """Sequences running on the worker at `address` (its own GetLoad)."""
    with grpc.insecure_channel(address) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                           timeout=5.0).load
    return int(load.num_running)


def epochs(stack: Stack) -> dict[str, int]:
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5.0)
    return {w.info.worker_id: w.info.epoch for w in listed.workers}


def wait_back(stack: Stack, before: dict[str, int], killed: str) -> None:
    """Wait until both workers run and are registered, `killed` under a new epoch."""
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            now = epochs(stack)
        except grpc.RpcError:
            now = {}
        if set(now) == set(stack.worker_ids) and now[killed] != before[killed] and all(
                stack.service_healthy(w) for w in stack.worker_ids):
            return
        time.sleep(0.2)  # polling the registry: a restart gives no other signal
    raise AssertionError(f"workers not back within {BACK_TIMEOUT_S}s: {epochs(stack)}")


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_requests_complete_as_on_one_mixed_worker_when_a_worker_is_killed(
        stack: Stack, reference: list[dict[str, Any]], victim: str) -> None:
    address = dict(zip(stack.worker_ids, stack.worker_addresses, strict=True))[victim]
    before = epochs(stack)

    (scheduler,) = [s for s in stack.services if s.role == "scheduler"]
    routed = 'meshserve:scheduler_routed_total'
    label = '{worker_id="prefill-0"}'
    prefilled = metric(scheduler.metrics_url, routed, label)
    (gateway,) = stack.gateway_metrics_urls
    failovers = 'meshserve:gateway_failovers_total', '{outcome="resumed"}'
    moved = metric(gateway, *failovers)
    generated = "meshserve:worker_generated_tokens_total"
    decoded = worker_metric(stack, "decode-0", generated)

    def placed() -> bool:
        """Whether the victim holds requests: all routed to the (stopped) prefill worker,
        or some running on the decode worker."""
        if victim == "prefill-0":
            return metric(scheduler.metrics_url, routed, label) >= prefilled + FAULT_REQUESTS
        return running_on(address) > 0

    async def scenario() -> list[dict[str, Any]]:
        if victim == "prefill-0":  # stopped first: killed mid-prompt, before any token
            stack.kill(victim, signal.SIGSTOP)
        answers = asyncio.ensure_future(
            complete_all(stack, fault_prompts(), FAULT_MAX_TOKENS))
        while not answers.done() and not await asyncio.to_thread(placed):
            await asyncio.sleep(0.005)  # polling the counters: nothing signals it
        assert not answers.done(), f"{victim} ran none of the requests"
        stack.kill(victim, signal.SIGKILL)
        return await answers

    answers = asyncio.run(scenario())
    faults = reference[REQUESTS + 1:REQUESTS + 1 + FAULT_REQUESTS]
    for i, (got, want) in enumerate(zip(answers, faults, strict=True)):
        assert_same(got, want, f"request {i} ({victim} killed)")
    if victim == "prefill-0":  # no token came before the kill: each retried on decode-0
        assert worker_metric(stack, "decode-0", generated) - decoded \
            == FAULT_REQUESTS * FAULT_MAX_TOKENS
    else:  # those decoding there resumed from their tokens (on the prefill worker)
        assert metric(gateway, *failovers) > moved
    wait_back(stack, before, victim)


def test_with_the_kvstore_stopped_the_decode_worker_recomputes_the_prompts(
        stack: Stack, reference: list[dict[str, Any]]) -> None:
    sent = handoff_blocks(stack, "prefill-0", "sent")
    received = handoff_blocks(stack, "decode-0", "received")
    late = 'meshserve:kv_handoff_late_sends_total'
    late_before = worker_metric(stack, "prefill-0", late)
    stack.kill("kvstore", signal.SIGSTOP)
    try:
        answers = asyncio.run(complete_all(stack, storeless_prompts()))
    finally:
        stack.kill("kvstore", signal.SIGCONT)
    for i, (got, want) in enumerate(zip(answers, reference[-5:], strict=True)):
        assert_same(got, want, f"request {i} (no kvstore)")
    # Handed off all the same, with no block: each was late, the decode worker found none.
    assert handoff_blocks(stack, "prefill-0", "sent") == sent
    assert worker_metric(stack, "prefill-0", late) == late_before + 5
    assert handoff_blocks(stack, "decode-0", "received") == received
