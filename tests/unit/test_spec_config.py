"""--speculative-config: vLLM's JSON parsed into SpeculativeConfig, or refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.cli.up import positional_model
from meshserve.cli.vllm_options import translate
from meshserve.local.launcher import LauncherConfig
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.errors import ConfigError
from meshserve.shared.speculative_config import SpeculativeConfig, parse_speculative_config


def test_ngram_config_as_vllm_spells_it() -> None:
    got = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                   '"prompt_lookup_max": 4, "prompt_lookup_min": 1}')
    assert got == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=1)


def test_model_alone_means_a_draft_model() -> None:
    got = parse_speculative_config('{"model": "/m/draft", "num_speculative_tokens": 3}')
    assert (got.method, got.model, got.num_speculative_tokens) == ("draft_model", "/m/draft", 3)
    named = parse_speculative_config('{"method": "draft_model", "model": "/m/draft", '
                                     '"num_speculative_tokens": 3}')
    assert named == got


def test_a_whole_draft_and_log_stats_keys_are_taken_as_vllm_spells_them() -> None:
    got = parse_speculative_config('{"model": "/m/d", "num_speculative_tokens": 3, '
                                   '"draft_tensor_parallel_size": 1, "disable_log_stats": true}')
    assert (got.method, got.model) == ("draft_model", "/m/d")


def test_lookup_bounds_default() -> None:
    assert parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_max == 4
    six = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}')
    assert (six.prompt_lookup_min, six.prompt_lookup_max) == (6, 6)


@pytest.mark.parametrize(("text", "match"), [
    ("not json", "JSON object"),
    ("[1]", "JSON object"),
    ('{"num_speculative_tokens": 3}', "needs \"method\""),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
    (('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 2}'), "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "ngram", "model": "/x", "num_speculative_tokens": 3}', "only with it"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "acceptance_method": "x"}',
     "not supported by meshserve: acceptance_method"),
    ('{"model": "/m/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}',
     "draft_tensor_parallel_size must be 1"),
])
def test_bad_configs_are_refused_with_a_reason(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_speculative_config(text)


def test_engine_config_validates_the_json() -> None:
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert config.speculative == SpeculativeConfig("ngram", 2)
    assert EngineConfig().speculative is None
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative_config='{"method": "ngram"}')


def test_vllm_serve_spelling_reaches_the_engine_config(tmp_path: Path) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    config = LauncherConfig.from_args(
        translate(positional_model(["m", "--speculative-config", spec])), environ={})
    assert config.speculative == SpeculativeConfig("ngram", 3)
    # As a --config YAML mapping, the way vLLM's files write it.
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    from_file = LauncherConfig.from_args(translate(positional_model(["m", "--config", str(yaml_file)])),
                                         environ={})
    assert from_file.speculative == SpeculativeConfig("ngram", 2)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LauncherConfig.from_args(positional_model(["m", "--speculative-config",
                                                  '{"method": "ngram"}']),
                                 environ={})
