"""Every field of the OpenAI request schemas (as the `openai` package types them) and of
vLLM's extensions is either read by meshserve's parser or refused with a 400 naming it:
none is silently ignored."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.openai_protocol import (
    UNSUPPORTED_CHAT_FIELDS,
    UNSUPPORTED_COMPLETION_FIELDS,
    parse_chat_request,
    parse_completion_request,
)

# What the parsers read (their own tests check each one's effect).
READ_BY_COMPLETIONS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user"}
READ_BY_CHAT = {
    "model", "messages", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "safety_identifier", "parallel_tool_calls"}
# vLLM's extra request fields (its CompletionRequest / ChatCompletionRequest), read here.
VLLM_READ = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
             "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
             "spaces_between_special_tokens", "add_special_tokens", "priority", "cache_salt",
             "truncate_prompt_tokens", "prompt_logprobs", "return_tokens_as_token_ids",
             "response_format", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar", "guided_decoding_backend",
             "guided_whitespace_pattern", "bad_words", "allowed_token_ids",
             "return_token_ids"}
VLLM_CHAT_READ = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                  "chat_template", "include_reasoning"}


def openai_fields(params: Any) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsBase))


def test_every_openai_completion_field_is_read_or_refused() -> None:
    unknown = openai_fields(completion_create_params) - READ_BY_COMPLETIONS \
        - set(UNSUPPORTED_COMPLETION_FIELDS)
    assert not unknown, f"classify these /v1/completions fields: {sorted(unknown)}"


def test_every_openai_chat_field_is_read_or_refused() -> None:
    unknown = openai_fields(chat_create_params) - READ_BY_CHAT - set(UNSUPPORTED_CHAT_FIELDS)
    assert not unknown, f"classify these /v1/chat/completions fields: {sorted(unknown)}"


def test_no_field_is_both_read_and_refused() -> None:
    assert not (READ_BY_COMPLETIONS | VLLM_READ) & set(UNSUPPORTED_COMPLETION_FIELDS)
    assert not (READ_BY_CHAT | VLLM_READ | VLLM_CHAT_READ) & set(UNSUPPORTED_CHAT_FIELDS)


def asking(value: tuple[object, ...]) -> object:
    """A value that asks for something: not null and not one of the harmless ones."""
    for candidate in ("x", 7, True, ["x"], {"x": 1}):
        if not any(candidate == ok and type(candidate) is type(ok) for ok in value):
            return candidate
    raise AssertionError(value)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_COMPLETION_FIELDS))
def test_completions_refuse_the_field_by_name(field: str) -> None:
    harmless, _ = UNSUPPORTED_COMPLETION_FIELDS[field]
    body = {"model": "m", "prompt": "hi"}
    with pytest.raises(InvalidRequestError) as refused:
        parse_completion_request({**body, field: asking(harmless)})
    assert refused.value.param == field and "not supported" in refused.value.message
    for fine in (None, *harmless):  # null and the values that ask for nothing pass
        parse_completion_request({**body, field: fine})


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_CHAT_FIELDS))
def test_chat_refuses_the_field_by_name(field: str) -> None:
    harmless, _ = UNSUPPORTED_CHAT_FIELDS[field]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequestError) as refused:
        parse_chat_request({**body, field: asking(harmless)})
    assert refused.value.param == field and "not supported" in refused.value.message
    for fine in (None, *harmless):
        parse_chat_request({**body, field: fine})


def test_echo_with_logprobs_asks_for_prompt_logprobs_without_returning_the_field() -> None:
    request = parse_completion_request({"prompt": "hi", "echo": True, "logprobs": 1})
    assert request.params.prompt_logprobs == 1
    assert not request.options.return_prompt_logprobs
    asked = parse_completion_request({"prompt": "hi", "prompt_logprobs": 0})
    assert asked.params.prompt_logprobs == 0 and asked.options.return_prompt_logprobs
    for bad, stream in ((-2, False), (1, True), (-1, True)):  # -1: the whole vocabulary
        with pytest.raises(InvalidRequestError) as refused:
            parse_completion_request({"prompt": "hi", "prompt_logprobs": bad, "stream": stream})
        assert refused.value.param == "prompt_logprobs"
