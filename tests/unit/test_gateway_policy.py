"""The gateway's pure decisions: max_tokens defaults against the context, its config."""

from __future__ import annotations

import pytest

from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.flow.admission import Admission
from meshserve.services.gateway.flow.job import GenerationJob, PreparedPrompt, resolve_max_tokens
from meshserve.shared.errors import ConfigError, ContextLengthError, OverloadedError
from meshserve.shared.openai_protocol import RequestOptions
from meshserve.shared.sampling_params import SamplingParams


def job(max_tokens: int | None, default: int | None, chat: bool = False) -> GenerationJob:
    return GenerationJob(model="m", prompts=("x",), params=SamplingParams(max_tokens=max_tokens),
                         options=RequestOptions(), deadline=1.0, arrival=0.0, chat=chat,
                         max_tokens=max_tokens, default_max_tokens=default)


def prompt(size: int, limit: int | None = 100) -> PreparedPrompt:
    return PreparedPrompt(list(range(size)), None, limit)


@pytest.mark.parametrize(("max_tokens", "default", "prompts", "expected"), [
    (None, 16, [prompt(10)], 16),  # the legacy completions default
    (None, 16, [prompt(90)], 10),  # a default is capped at the room left
    (None, 16, [prompt(10), prompt(95)], 5),  # by the fullest prompt
    (None, None, [prompt(99)], None),  # up to the context: the worker caps it
    (20, 16, [prompt(80)], 20),  # explicit and fits exactly
    (50, None, [prompt(10, None)], 50),  # context unknown here: the worker checks
])
def test_max_tokens(max_tokens: int | None, default: int | None,
                    prompts: list[PreparedPrompt], expected: int | None) -> None:
    assert resolve_max_tokens(job(max_tokens, default), prompts) == expected


def test_context_errors_name_the_parameter() -> None:
    with pytest.raises(ContextLengthError) as full:
        resolve_max_tokens(job(None, 16, chat=True), [prompt(100)])
    assert full.value.param == "messages"
    with pytest.raises(ContextLengthError) as over:
        resolve_max_tokens(job(21, 16), [prompt(80)])
    assert over.value.param == "max_tokens" and "101 tokens" in over.value.message


def test_config_lists_and_default_policy() -> None:
    config = GatewayConfig.from_args(
        ["--tokenizer-addresses", "a:1, b:2", "--chat-default-max-tokens", "64"], environ={})
    assert config.tokenizer_addresses == ("a:1", "b:2")
    assert config.default_max_tokens(chat=True) == 64
    assert config.default_max_tokens(chat=False) == 16
    assert GatewayConfig().default_max_tokens(chat=True) is None
    env = GatewayConfig.from_args([], environ={"MESHSERVE_COMPLETIONS_DEFAULT_MAX_TOKENS": "0"})
    assert env.default_max_tokens(chat=False) is None
    assert GatewayConfig().max_failovers == 2
    assert GatewayConfig.from_args(["--max-failovers", "0"], environ={}).max_failovers == 0
    assert GatewayConfig.from_args([], environ={"MESHSERVE_MAX_FAILOVERS": "5"}).max_failovers == 5


@pytest.mark.parametrize(("field", "value"), [
    ("max_concurrent_requests", 0), ("request_timeout_s", 0.0), ("tokenizer_addresses", ()),
    ("chat_default_max_tokens", -1), ("api_key", ""), ("max_body_bytes", 0),
    ("max_failovers", -1)])
def test_config_rejects(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        GatewayConfig(**{field: value})
    assert info.value.param == field


def test_admission_bound() -> None:
    admission = Admission(2)
    with admission.slot(), admission.slot():
        with pytest.raises(OverloadedError), admission.slot():
            pass
        assert admission.in_flight == 2
    assert admission.in_flight == 0
    with admission.slot():
        assert admission.in_flight == 1
