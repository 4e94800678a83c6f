"""`meshserve up` with `--quantization fp8 --kv-cache-dtype fp8`, driven by the real `openai`
client: the mesh serves the FP8 model with the same greedy text as the in-process engine with
the same flags (real processes, real Redis, real gRPC and HTTP on loopback)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

API_KEY = "fp8-key"
PROMPT = [17, 230, 41, 99, 7, 310, 12, 64, 5, 88, 140, 33]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fp8-e2e"), "llama", seed=5)


def engine_text(model_dir: Path) -> str:
    engine = build_engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                    num_kv_blocks=64, quantization="fp8", kv_cache_dtype="fp8"))
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == MAX_TOKENS
    return AutoTokenizer.from_pretrained(model_dir).decode(tokens)


def test_the_mesh_serves_fp8_weights_and_kv_like_the_engine(
        model_dir: Path, tmp_path: Path) -> None:
    expected = engine_text(model_dir)
    config = LauncherConfig(model=str(model_dir), served_model_name="tiny-fp8", workers=1,
                            port=0, api_key=API_KEY, num_kv_blocks=64, dtype="float32",
                            device="cpu", quantization="fp8", kv_cache_dtype="fp8",
                            run_dir=str(tmp_path / "run"), startup_timeout_s=300,
                            stop_grace_s=10)
    with start_stack(config) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0,
                               timeout=120)
        reply = client.completions.create(model="tiny-fp8", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert reply.choices[0].text == expected
    assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
