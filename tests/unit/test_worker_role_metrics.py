"""`meshserve:worker_pending_prefill_tokens{role}`: the prefill pool's autoscaling signal,
read from a real engine on a tiny model as a chunked prefill works through two prompts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.serving.role_metrics import (
    PENDING_PREFILL_TOKENS,
    register_role_gauges,
)
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.worker_registry import WorkerLoad


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)
    return build_engine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                     num_kv_blocks=64, max_model_len=256,
                                     max_num_batched_tokens=64, async_scheduling="off"))


def scrape(registry: CollectorRegistry) -> dict[tuple[str, ...], float]:
    """{(sample name, role): value} of the exposition."""
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("role", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_gauge_counts_the_prompt_tokens_not_yet_computed(engine: LLMEngine) -> None:
    def snapshot() -> WorkerLoad:
        return WorkerLoad(num_pending_prefill_tokens=engine.load().num_pending_prefill_tokens)

    registry = CollectorRegistry()
    register_role_gauges(registry, "prefill", snapshot)
    assert scrape(registry) == {(PENDING_PREFILL_TOKENS, "prefill"): 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(3, 103)), params)
    engine.add_request("b", list(range(200, 250)), params)
    assert scrape(registry)[(PENDING_PREFILL_TOKENS, "prefill")] == 150
    engine.step()  # one step of 64 tokens: the first 64 of "a"
    assert scrape(registry)[(PENDING_PREFILL_TOKENS, "prefill")] == 150 - 64
    while engine.has_unfinished_requests():
        engine.step()
    assert scrape(registry)[(PENDING_PREFILL_TOKENS, "prefill")] == 0


def test_each_role_is_its_own_series() -> None:
    registry = CollectorRegistry()
    register_role_gauges(registry, "decode", lambda: WorkerLoad(num_pending_prefill_tokens=7))
    assert scrape(registry) == {(PENDING_PREFILL_TOKENS, "decode"): 7.0}
