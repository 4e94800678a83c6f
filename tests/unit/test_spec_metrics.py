"""vLLM's spec_decode counters, as the worker's /metrics exposes them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from meshserve.services.worker.serving.spec_metrics import register_spec_metrics
from meshserve.services.worker.spec.decoder import NgramBatchProposer, SpecDecoder
from meshserve.shared.speculative_config import SpeculativeConfig


def test_counters_carry_vllm_names_model_name_and_positions() -> None:
    config = SpeculativeConfig("ngram", 3)
    spec = SpecDecoder(config, NgramBatchProposer(config), max_model_len=64)
    spec.stats.record(num_drafts=3, num_accepted=2)
    spec.stats.record(num_drafts=2, num_accepted=0)
    registry = CollectorRegistry()
    register_spec_metrics(registry, spec, "m1")
    text = generate_latest(registry).decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m1"} 2.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m1"} 5.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m1"} 2.0',
                 ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m1",'
                 'position="0"} 1.0'),
                 ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m1",'
                 'position="1"} 1.0'),
                 ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m1",'
                 'position="2"} 0.0')):
        assert line in text.splitlines(), line
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text


def test_nothing_is_registered_without_speculation() -> None:
    registry = CollectorRegistry()
    register_spec_metrics(registry, None, "m1")
    assert "spec_decode" not in generate_latest(registry).decode()
