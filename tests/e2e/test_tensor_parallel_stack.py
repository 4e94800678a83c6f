"""A tensor-parallel worker in the real stack: `meshserve up` (start_stack) with one worker
at --tensor-parallel-size 2 on CPU (gloo), driven through the gateway by the `openai`
client. Its tokens are those of the same model run in-process on one rank, a LoRA
adapter (given at start, or loaded at run time) gives transformers + peft's tokens, the
scheduler knows it as one worker of two ranks, a dead rank ends its worker with a message
naming it, and `kill -9` of the worker leaves no rank behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from lora_adapters import build_adapter, greedy, peft_model
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

MODEL = "tiny-tp"
PROMPTS = [[5, 17, 99, 3, 250, 42, 8], [300, 301, 302] * 9]
MAX_TOKENS = 8
GONE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tp-stack-model"), "llama", seed=5)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-adapters")
    return {name: build_adapter(model_dir, root / name, seed=50 + i, rank=8)
            for i, name in enumerate(("boot", "late"))}


@pytest.fixture(scope="module")
def stack(model_dir: Path, adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=1, port=0,
                            tensor_parallel_size=2, num_kv_blocks=128, dtype="float32",
                            device="cpu", kvstore=False, enable_lora=True, max_loras=1,
                            lora_modules=f"boot={adapters['boot']}",
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    environ = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with start_stack(config, environ=environ) as running:
        yield running


def one_rank_tokens(model_dir: Path) -> list[list[int]]:
    engine = build_engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                    num_kv_blocks=128, structured_outputs_backend="none"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and running(int(entry)) and parent_of(int(entry)) == pid:
            found.append(int(entry))
    return found


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_two_ranks_serve_the_tokens_of_one(stack: Stack, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0,
                           timeout=120)
    served = []
    for prompt in PROMPTS:
        completion = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = completion.choices[0]
        assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
        served.append(list(choice.token_ids))  # type: ignore[attr-defined]
    assert served == one_rank_tokens(model_dir)
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5.0)
    assert [w.info.tensor_parallel_size for w in listed.workers] == [2]


def test_adapters_on_two_ranks_give_peft_tokens(stack: Stack, model_dir: Path,
                                               adapters: dict[str, Path]) -> None:
    """The adapter given at start, then one loaded at run time (one slot: they take turns
    in it, each rank holding its part of whichever is there)."""
    request = urllib.request.Request(
        stack.gateway_url + "/v1/load_lora_adapter", method="POST",
        data=json.dumps({"lora_name": "late", "lora_path": str(adapters["late"])}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0,
                           timeout=120)
    for name in ("boot", "late", "boot"):
        completion = client.completions.create(
            model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        served = list(completion.choices[0].token_ids)  # type: ignore[attr-defined]
        assert served == greedy(peft_model(model_dir, adapters[name]), PROMPTS[1],
                                MAX_TOKENS), name


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    # Polling: another process's exit or restart gives this test no other signal.
    while not condition():
        assert time.monotonic() < deadline, f"not within {GONE_TIMEOUT_S}s: {what}"
        time.sleep(0.1)


def test_a_dead_rank_ends_its_worker_with_a_message_naming_it(stack: Stack) -> None:
    worker = stack.pid("worker-0")
    assert worker is not None
    (rank,) = children_of(worker)
    os.kill(rank, signal.SIGKILL)
    wait_until(lambda: not running(worker), "the worker exits after its rank died")
    log = next(s for s in stack.services if s.name == "worker-0").log_path.read_text()
    assert "tensor-parallel rank 1 exited with code -9" in log
    # The supervisor starts the worker again, with a new rank.
    wait_until(lambda: stack.pid("worker-0") not in (None, worker)
               and stack.service_healthy("worker-0"), "the worker is back")


def test_killing_the_worker_leaves_no_rank_behind(stack: Stack) -> None:
    worker = stack.pid("worker-0")
    assert worker is not None
    ranks = children_of(worker)
    assert len(ranks) == 1, f"expected one follower rank of worker pid {worker}, got {ranks}"
    stack.kill("worker-0", signal.SIGKILL)
    wait_until(lambda: not running(ranks[0]), f"rank 1 (pid {ranks[0]}) outlived its killed "
                                              "worker")
