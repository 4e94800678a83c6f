"""Multi-LoRA serving through the whole mesh (`meshserve up`), with the real `openai` client.

Two CPU workers started with --enable-lora and one adapter from --lora-modules; adapters are
loaded and unloaded at runtime through the gateway (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and
one straight on a single worker to check that the scheduler routes its requests there. Every
adapter's greedy tokens are compared with transformers + peft on the same weights.
"""

from __future__ import annotations

import json
import os
import random
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from lora_adapters import build_adapter, greedy, peft_model
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.proto.v1 import worker_pb2, worker_pb2_grpc

MODEL = "tiny"
MAX_NEW = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-e2e")
    base = build_tiny_model(root / "base", "llama", seed=6)
    return {"base": base, **{name: build_adapter(base, root / name, seed=30 + i, rank=8)
                             for i, name in enumerate(("boot", "late", "solo"))}}


@pytest.fixture(scope="module")
def stack(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    config = LauncherConfig(model=str(folders["base"]), served_model_name=MODEL, workers=2,
                            port=0, num_kv_blocks=256, dtype="float32", device="cpu",
                            enable_lora=True, max_loras=2,
                            lora_modules=f"boot={folders['boot']}",
                            # Round-robin would alternate workers: the adapter test below
                            # shows that an adapter's requests still go where it is.
                            routing="round-robin",
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    environ = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with start_stack(config, environ=environ) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


PROMPTS = [[random.Random(i).randrange(3, 400) for _ in range(12 + 5 * i)] for i in range(4)]


def greedy_ids(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW,
                                    temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True,
                                                "ignore_eos": True})
    assert out.model == model
    return [int(t.removeprefix("token_id:"))
            for t in out.choices[0].logprobs.tokens]  # type: ignore[union-attr]


def reference(folders: dict[str, Path], adapter: str, prompt: list[int]) -> list[int]:
    return greedy(peft_model(folders["base"], folders[adapter]), prompt, MAX_NEW)


def post(stack, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(stack.gateway_url + path, data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def models(client: openai.OpenAI) -> dict[str, str | None]:
    return {m.id: m.model_extra["parent"] for m in client.models.list()}  # type: ignore[index]


def test_a_startup_adapter_is_listed_and_runs(stack, client, folders) -> None:
    assert models(client) == {MODEL: None, "boot": MODEL}
    for prompt in PROMPTS[:2]:
        assert greedy_ids(client, "boot", prompt) == reference(folders, "boot", prompt)
    # An adapter tokenizes as its base model.
    tokenized = [post(stack, "/tokenize", {"model": m, "prompt": "the quick brown fox"})
                 for m in ("boot", MODEL)]
    assert tokenized[0][0] == 200 and tokenized[0] == tokenized[1]
    # The base model next to it is still the base model.
    base = greedy_ids(client, MODEL, PROMPTS[0])
    assert base != greedy_ids(client, "boot", PROMPTS[0])


def test_load_run_unload_at_runtime(stack, client, folders) -> None:
    code, text = post(stack, "/v1/load_lora_adapter",
                      {"lora_name": "late", "lora_path": str(folders["late"])})
    assert (code, text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert models(client)["late"] == MODEL
    assert greedy_ids(client, "late", PROMPTS[2]) == reference(folders, "late", PROMPTS[2])
    code, text = post(stack, "/v1/load_lora_adapter",
                      {"lora_name": "late", "lora_path": str(folders["late"])})
    assert code == 400 and "already been loaded" in text
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200
    assert "late" not in models(client)
    with pytest.raises(openai.NotFoundError, match="late"):
        greedy_ids(client, "late", PROMPTS[2])
    code, text = post(stack, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert code == 404 and "cannot be found" in text


def test_a_bad_adapter_fails_alone(stack, client, folders, tmp_path: Path) -> None:
    code, text = post(stack, "/v1/load_lora_adapter",
                      {"lora_name": "ghost", "lora_path": str(tmp_path / "nothing-here")})
    assert code == 404 and "adapter_config.json" in json.loads(text)["error"]["message"]
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((folders["late"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    code, text = post(stack, "/v1/load_lora_adapter",
                      {"lora_name": "dora", "lora_path": str(dora)})
    assert code == 400 and "DoRA" in json.loads(text)["error"]["message"]
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400  # no path
    assert set(models(client)) == {MODEL, "boot"}  # nothing else lost
    assert greedy_ids(client, "boot", PROMPTS[3]) == reference(folders, "boot", PROMPTS[3])


def test_requests_go_to_the_worker_that_has_the_adapter(stack, client, folders) -> None:
    """An adapter loaded on one worker only: under round-robin routing its requests all
    succeed (the other worker refuses an adapter it lacks), with the adapter's tokens."""
    with grpc.insecure_channel(stack.worker_addresses[0]) as channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        worker.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(
            lora_name="solo", lora_path=str(folders["solo"])), timeout=60)
        names = [a.name for a in worker.GetInfo(worker_pb2.GetInfoRequest()).info.loras]
    assert names == ["boot", "solo"]
    with grpc.insecure_channel(stack.worker_addresses[1]) as channel:
        other = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    assert [a.name for a in other.info.loras] == ["boot"]
    for prompt in PROMPTS:
        assert greedy_ids(client, "solo", prompt) == reference(folders, "solo", prompt)
