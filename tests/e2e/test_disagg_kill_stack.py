"""`kill -9` of prefill workers under disaggregated serving with the TCP handoff (issue 32).

One `meshserve up`-like stack of two prefill workers and one decode worker, `--kv-handoff
tcp`, no kvstore, and at most one sequence running per worker (`--max-num-seqs 1`): a
worker's other sequences wait in its queue. Each fault run's requests are compared with
the same prompts run first on the same stack under another `cache_salt` (no prefix hit
between the two runs): the same greedy tokens, logprobs to float32 rounding.

- A prefill worker dies mid-prompt: it is stopped first, so that the requests routed to it
  wait there unstarted, then killed; each is prefilled on the other prefill worker, handed
  off and decoded as before.
- A prefill worker dies after the first token and before the decode worker pulls: a long
  stream of a short prompt (run whole on the decode worker) holds the decode worker's only
  running slot, so the handed-off requests wait in its queue, their blocks not yet probed
  (the decode worker's own GetLoad counts them waiting) once every client has read its
  first token. Both prefill workers are then killed and the long stream closed: the
  decode worker finds each source gone (meshserve:kv_handoff_failed_pulls_total) and
  recomputes the prompt, with no failover.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from test_disagg_stack import assert_same, handoff_blocks, metric, worker_metric
from test_failover import epochs, wait_back
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc

MODEL = "tiny-disagg-kill"
BLOCK = 16
MIN_PROMPT_TOKENS = 32
MAX_TOKENS = 6
MID_PROMPT_REQUESTS = 4
UNPULLED_REQUESTS = 3
HOLD_MAX_TOKENS = 1500  # the decode worker's slot holder: far longer than the scenario
HOLD_PROMPT = [17, 23, 42, 99, 7, 8, 120, 33, 61, 5]  # under MIN_PROMPT_TOKENS: run whole
REFERENCE_SALT = "reference"
PLACED_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("disagg-kill-model"), "llama", seed=34,
                            max_position_embeddings=2048)


def prompts(seed: int, count: int) -> list[list[int]]:
    """Long prompts (2 to 4 full blocks and a partial one), distinct from their first block."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(rng.randrange(2 * BLOCK, 4 * BLOCK) + 5)]
            for _ in range(count)]


MID_PROMPT = prompts(341, MID_PROMPT_REQUESTS)
UNPULLED = prompts(342, UNPULLED_REQUESTS)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = LauncherConfig(
        model=str(model_dir), served_model_name=MODEL, port=0, kvstore=False, workers=0,
        prefill_workers=2, decode_workers=1, kv_handoff="tcp", max_num_seqs=1,
        disagg_min_prompt_tokens=MIN_PROMPT_TOKENS, num_kv_blocks=512, block_size=BLOCK,
        dtype="float32", device="cpu", run_dir=str(tmp_path_factory.mktemp("disagg-kill")),
        startup_timeout_s=300, stop_grace_s=5)
    with start_stack(config) as running:
        yield running


@dataclass
class Stream:
    """What one client stream of a completion received."""

    prompt: list[int]
    max_tokens: int = MAX_TOKENS
    salt: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    finish_reason: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def answer(self) -> dict[str, Any]:
        """As test_disagg_stack's assert_same compares (the text is the tokens')."""
        return {"text": "".join(self.tokens), "tokens": self.tokens,
                "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs}


async def run(client: openai.AsyncOpenAI, stream: Stream, stop: asyncio.Event | None = None
              ) -> None:
    """Read a greedy completion stream to its end (or until `stop` is set, then close it);
    `started` is set once its first token came."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if stream.salt is not None:
        extra["cache_salt"] = stream.salt
    response = await client.completions.create(
        model=MODEL, prompt=stream.prompt, max_tokens=stream.max_tokens, temperature=0,
        logprobs=2, stream=True, extra_body=extra)
    try:
        async for chunk in response:
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    stream.tokens += choice.logprobs.tokens or []
                    stream.token_logprobs += choice.logprobs.token_logprobs or []
                    stream.top_logprobs += choice.logprobs.top_logprobs or []
                stream.finish_reason = choice.finish_reason or stream.finish_reason
            if stream.tokens:
                stream.started.set()
            if stop is not None and stop.is_set():
                return
    finally:
        stream.started.set()  # at its end too: nobody waits for a stream that is over
        await response.close()


def client_for(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none",
                              max_retries=0, timeout=120)


async def run_all(stack: Stack, streams: list[Stream]) -> None:
    async with client_for(stack) as client:
        await asyncio.gather(*(run(client, s) for s in streams))


@pytest.fixture(scope="module")
def reference(stack: Stack) -> dict[str, list[Stream]]:
    """Every fault run's prompts, unkilled, under a salt of their own."""
    runs = {"mid_prompt": [Stream(p, salt=REFERENCE_SALT) for p in MID_PROMPT],
            "unpulled": [Stream(p, salt=REFERENCE_SALT) for p in UNPULLED]}
    asyncio.run(run_all(stack, [s for streams in runs.values() for s in streams]))
    return runs


def assert_as_reference(streams: list[Stream], reference: list[Stream], what: str) -> None:
    for i, (got, want) in enumerate(zip(streams, reference, strict=True)):
        assert got.finish_reason == want.finish_reason == "length", f"{what}: request {i}"
        assert len(got.tokens) == MAX_TOKENS, f"{what}: request {i}"
        assert_same(got.answer(), want.answer(), f"{what}: request {i}")


def load_of(stack: Stack, worker_id: str) -> common_pb2.WorkerLoad:
    """The worker's load from its own GetLoad."""
    address = dict(zip(stack.worker_ids, stack.worker_addresses, strict=True))[worker_id]
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                           timeout=5.0).load


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` (blocking, run off the loop): counters give no other signal."""
    deadline = time.monotonic() + PLACED_TIMEOUT_S
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"not within {PLACED_TIMEOUT_S}s: {what}"
        await asyncio.sleep(0.005)


def routed(stack: Stack, worker_id: str) -> float:
    (scheduler,) = [s for s in stack.services if s.role == "scheduler"]
    return metric(scheduler.metrics_url, "meshserve:scheduler_routed_total",
                  f'{{worker_id="{worker_id}"}}')


def test_a_prefill_worker_killed_mid_prompt_its_requests_are_prefilled_on_the_other(
        stack: Stack, reference: dict[str, list[Stream]]) -> None:
    before = epochs(stack)
    generated = "meshserve:worker_generated_tokens_total"
    first_tokens = worker_metric(stack, "prefill-0", generated)
    sent = handoff_blocks(stack, "prefill-0", "sent")
    routed_before = {w: routed(stack, w) for w in ("prefill-0", "prefill-1")}
    streams = [Stream(p) for p in MID_PROMPT]

    async def scenario() -> float:
        stack.kill("prefill-1", signal.SIGSTOP)  # what it is given waits there, unstarted
        async with client_for(stack) as client:
            answers = asyncio.gather(*(run(client, s) for s in streams))

            def placed() -> bool:
                return sum(routed(stack, w) - n for w, n in routed_before.items()) \
                    >= MID_PROMPT_REQUESTS
            await wait_for(placed, "every request routed to a prefill worker")
            on_killed = routed(stack, "prefill-1") - routed_before["prefill-1"]
            stack.kill("prefill-1", signal.SIGKILL)
            await answers
        return on_killed

    on_killed = asyncio.run(scenario())
    assert on_killed > 0, "the router gave the stopped worker nothing"
    assert_as_reference(streams, reference["mid_prompt"], "prefill-1 killed mid-prompt")
    # Every prompt was computed (one token each) and handed off by the prefill worker left.
    assert worker_metric(stack, "prefill-0", generated) == first_tokens + MID_PROMPT_REQUESTS
    assert handoff_blocks(stack, "prefill-0", "sent") \
        == sent + sum(len(p) // BLOCK for p in MID_PROMPT)
    wait_back(stack, before, ["prefill-1"])


def test_prefill_workers_killed_after_the_first_token_before_the_pull_decode_recomputes(
        stack: Stack, reference: dict[str, list[Stream]]) -> None:
    """The module's last test: the stack stops with its prefill workers restarting."""
    failed = "meshserve:kv_handoff_failed_pulls_total"
    failed_before = worker_metric(stack, "decode-0", failed)
    received = handoff_blocks(stack, "decode-0", "received")
    pulled = worker_metric(stack, "decode-0", "meshserve:kv_handoff_pulled_bytes_total")
    prefills = ("prefill-0", "prefill-1")
    sent = sum(handoff_blocks(stack, w, "sent") for w in prefills)
    gateway = next(s for s in stack.services if s.role == "gateway")
    failovers = "meshserve:gateway_failovers_total", '{outcome="resumed"}'
    moved = metric(gateway.metrics_url, *failovers)
    holder = Stream(HOLD_PROMPT, max_tokens=HOLD_MAX_TOKENS)
    streams = [Stream(p) for p in UNPULLED]

    async def scenario() -> float:
        release = asyncio.Event()
        async with client_for(stack) as client:
            holding = asyncio.ensure_future(run(client, holder, release))
            await holder.started.wait()  # the decode worker's one slot is taken
            answers = asyncio.gather(*(run(client, s) for s in streams))
            for stream in streams:
                await stream.started.wait()  # its first token, from a prefill worker
            await wait_for(lambda: load_of(stack, "decode-0").num_waiting == UNPULLED_REQUESTS,
                           "every request handed off and waiting on the decode worker")
            held = sum(handoff_blocks(stack, w, "sent") for w in prefills) - sent
            for worker_id in prefills:
                stack.kill(worker_id, signal.SIGKILL)
            release.set()  # the slot frees once its stream closes: the waiting ones start
            await holding
            await answers
        return held

    held = asyncio.run(scenario())
    # At the kill every prompt block was held by a prefill worker, and the holder still ran
    # (cut by the client, not finished): no waiting request had been probed yet.
    assert held == sum(len(p) // BLOCK for p in UNPULLED)
    assert holder.finish_reason is None and len(holder.tokens) < HOLD_MAX_TOKENS
    assert_as_reference(streams, reference["unpulled"], "prefill workers killed before the pull")
    # Each found its source gone and recomputed its prompt: no block arrived, no failover.
    assert worker_metric(stack, "decode-0", failed) == failed_before + UNPULLED_REQUESTS
    assert handoff_blocks(stack, "decode-0", "received") == received
    assert worker_metric(stack, "decode-0", "meshserve:kv_handoff_pulled_bytes_total") == pulled
    assert metric(gateway.metrics_url, *failovers) == moved
