"""Hundreds of concurrent streams through the real mesh equal the in-process engine's output.

The stack of `meshserve up` (tokenizer, scheduler, one worker, gateway as processes, real
Redis, gRPC and HTTP on loopback) serves 200 streaming completions at once, driven by the
real `openai` client; every stream's text and logprobs must equal what the same engine
gives in this process for that prompt (greedy). Then some streams go away mid-batch: the
others' outputs stay the same, and every KV block comes back.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.offline.llm import GenerationItem, OfflineLLM
from meshserve.proto.v1 import worker_pb2, worker_pb2_grpc
from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.shared.sampling_params import SamplingParams

MODEL = "tiny"
NUM_STREAMS = 200
MAX_TOKENS = 24
TOP_LOGPROBS = 2
# Logprobs of one position may differ in the last bits between batch compositions.
LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Output:
    """One stream's text and its logprobs (chosen, then top alternatives, sorted)."""

    text: str
    logprobs: list[float]
    top: list[list[float]]
    finish_reason: str | None


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids of ordinary tokens only (the tiny tokenizer's specials sit at its end).
    return [[rng.randrange(3, vocab - 8) for _ in range(rng.randrange(4, 40))]
            for _ in range(count)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("many-streams"), "llama", seed=11)


@pytest.fixture(scope="module")
def config(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LauncherConfig:
    return LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=1, port=0,
                          num_kv_blocks=2048, max_num_seqs=256, dtype="float32", device="cpu",
                          kvstore=False, run_dir=str(tmp_path_factory.mktemp("run")),
                          startup_timeout_s=300, stop_grace_s=10)


@pytest.fixture(scope="module")
def stack(config: LauncherConfig):
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def requests(model_dir: Path) -> list[list[int]]:
    return prompts(NUM_STREAMS, load_tokenizer(model_dir).vocab_size, seed=3)


@pytest.fixture(scope="module")
def reference(config: LauncherConfig, model_dir: Path,
              requests: list[list[int]]) -> list[Output]:
    """Every prompt through the same engine in this process, all at once."""
    engine = build_engine(config)
    llm = OfflineLLM(engine, load_tokenizer(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
    results = llm.generate([GenerationItem(f"ref-{i}", p, params)
                            for i, p in enumerate(requests)])
    outputs = []
    for result in results:
        (seq,) = result.sequences
        assert seq.logprobs is not None
        outputs.append(Output(seq.text, [lp.logprob for lp in seq.logprobs],
                              [sorted(v for _, v in lp.top) for lp in seq.logprobs],
                              seq.finish_reason))
    return outputs


async def stream_one(api: openai.AsyncOpenAI, prompt: list[int], *,
                     leave_after: int | None = None) -> Output | None:
    """One streaming completion; None when it left after `leave_after` chunks."""
    stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=TOP_LOGPROBS, stream=True)
    text, logprobs, top, finish = [], [], [], None
    chunks = 0
    async for chunk in stream:
        chunks += 1
        choice = chunk.choices[0]
        text.append(choice.text)
        if choice.logprobs is not None:
            logprobs.extend(choice.logprobs.token_logprobs or [])
            top.extend(sorted(d.values()) for d in choice.logprobs.top_logprobs or [])
        finish = choice.finish_reason or finish
        if leave_after is not None and chunks >= leave_after:
            await stream.close()  # the client goes away mid-stream
            return None
    return Output("".join(text), logprobs, top, finish)


def assert_same(got: Output, want: Output, where: str) -> None:
    assert got.text == want.text, where
    assert got.finish_reason == want.finish_reason, where
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_TOLERANCE), where
    assert len(got.top) == len(want.top), where
    for mine, theirs in zip(got.top, want.top, strict=True):
        # OpenAI's top_logprobs is keyed by token text: alternatives that decode alike
        # (parts of one UTF-8 character) collapse into one key, so every value shown
        # must be one of the reference's.
        assert 1 <= len(mine) <= len(theirs), where
        for value in mine:
            assert any(abs(value - ref) <= LOGPROB_TOLERANCE for ref in theirs), where


async def run_all(base_url: str, requests: Sequence[list[int]],
                  leave_after: dict[int, int]) -> list[Output | None]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                  timeout=300) as api:
        return await asyncio.gather(*(stream_one(api, p, leave_after=leave_after.get(i))
                                      for i, p in enumerate(requests)))


def worker_load(address: str) -> worker_pb2.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                           timeout=5).load


def wait_idle(address: str, timeout_s: float = 10.0) -> worker_pb2.GetLoadResponse:
    """The worker's load once nothing runs there (bounded wait on its reported state)."""
    deadline = time.monotonic() + timeout_s
    load = worker_load(address)
    while (load.num_running or load.num_waiting or load.num_used_blocks) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
        load = worker_load(address)
    return load


def test_200_concurrent_streams_equal_the_in_process_engine(stack, requests, reference) -> None:
    outputs = asyncio.run(run_all(stack.base_url, requests, {}))
    assert len(outputs) == NUM_STREAMS
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got is not None
        assert_same(got, want, f"stream {i}")
    load = wait_idle(stack.worker_addresses[0])
    assert load.num_used_blocks == 0 and load.num_running == 0


def test_streams_leaving_mid_batch_change_nothing_for_the_others(stack, requests,
                                                                 reference) -> None:
    # Every fifth stream leaves after a few chunks, at different points of the batch.
    leave_after = {i: 1 + i % 4 for i in range(0, NUM_STREAMS, 5)}
    outputs = asyncio.run(run_all(stack.base_url, requests, leave_after))
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        if i in leave_after:
            assert got is None
            continue
        assert got is not None
        assert_same(got, want, f"stream {i}")
    load = wait_idle(stack.worker_addresses[0])
    assert (load.num_used_blocks, load.num_running, load.num_waiting) == (0, 0, 0)
    assert load.num_free_blocks == load.num_total_blocks


def test_gateway_and_tokenizer_processes_never_load_torch(stack) -> None:
    for service in stack.services:
        if service.role not in ("gateway", "tokenizer"):
            continue
        assert service.process is not None
        maps = Path(f"/proc/{service.process.pid}/maps").read_text()
        assert "libtorch" not in maps, f"{service.name} has torch loaded"
    worker = next(s for s in stack.services if s.role == "worker")
    assert worker.process is not None
    assert "libtorch" in Path(f"/proc/{worker.process.pid}/maps").read_text()
