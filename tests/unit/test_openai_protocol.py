"""OpenAI request parsing and response building.

Response shapes are checked against the official `openai` client's models.
"""

from __future__ import annotations

import math

import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from meshserve.shared import openai_bodies as bodies
from meshserve.shared import openai_protocol as oai
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs


class FakeRenderer:
    """Token i is the text 't<i>' except 7, the first half of a two-byte character."""

    def token_text(self, token_id: int) -> str:
        return "\ufffd" if token_id == 7 else f"t{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return b"\xc3" if token_id == 7 else self.token_text(token_id).encode()


def error_of(body: dict[str, object], chat: bool = False) -> InvalidRequestError:
    parse = oai.parse_chat_request if chat else oai.parse_completion_request
    with pytest.raises(InvalidRequestError) as info:
        parse(body)
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# -- completions ------------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ("hi",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
])
def test_completion_prompt_forms(prompt: object, expected: tuple[object, ...]) -> None:
    assert oai.parse_completion_request({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [-1], [True], 5, {"a": 1}])
def test_bad_prompts_are_rejected(prompt: object) -> None:
    assert error_of({"prompt": prompt}).param == "prompt"


def test_completion_sampling_fields_map_to_params() -> None:
    request = oai.parse_completion_request({
        "model": "m", "prompt": "x", "n": 2, "best_of": 2, "temperature": 0, "top_p": 0.5,
        "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "logit_bias": {"12": 5, "7": -100}, "seed": 3,
        "min_tokens": 2, "max_tokens": 9, "stop": "END", "stop_token_ids": [4],
        "ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False,
        "priority": -1, "cache_salt": "s", "user": "u", "logprobs": 3, "echo": True,
        "some_future_key": {"ignored": True},
    })
    p = request.params
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 0.0, 0.5, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logit_bias == {12: 5.0, 7: -100.0}
    assert (p.seed, p.min_tokens, p.max_tokens, p.stop, p.stop_token_ids) == (
        3, 2, 9, ("END",), (4,))
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (
        True, True, False)
    assert (p.logprobs, p.prompt_logprobs) == (3, 3)  # echo asks for the prompt's too
    o = request.options
    assert (o.model, o.priority, o.cache_salt, o.user, request.echo) == ("m", -1, "s", "u", True)


def test_completion_defaults_follow_openai() -> None:
    request = oai.parse_completion_request({"prompt": "x", "temperature": None})
    assert (request.params.max_tokens, request.params.n, request.params.temperature) == (
        16, 1, 1.0)
    assert (request.options.stream, request.options.include_usage, request.echo) == (
        False, False, False)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("max_tokens", "5", "'max_tokens' must be an integer"),
    ("max_tokens", 1.5, "'max_tokens' must be an integer"),
    ("n", True, "'n' must be an integer"),
    ("temperature", "hot", "'temperature' must be a number"),
    ("echo", "yes", "'echo' must be a boolean"),
    ("logprobs", True, "'logprobs' must be an integer"),
    ("stop", 3, "'stop' must be a string or an array of strings"),
    ("stop_token_ids", [1, "2"], "'stop_token_ids' must be an array of token ids"),
    ("logit_bias", {"abc": 1}, "'logit_bias' keys must be token ids"),
    ("logit_bias", [1], "'logit_bias' must be an object"),
    ("user", 5, "'user' must be a string"),
])
def test_wrong_types_name_the_parameter(key: str, value: object, message: str) -> None:
    error = error_of({"prompt": "x", key: value})
    assert error.param == key
    assert error.message.startswith(message)


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": -2}, "logprobs"),  # -1 is the whole vocabulary; the worker bounds counts
    ({"top_p": 0}, "top_p"),
    ({"logit_bias": {"3": 101}}, "logit_bias"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"prompt": [1, 2], "suffix": "tail"}, "suffix"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_invalid_values_name_the_parameter(body: dict[str, object], param: str) -> None:
    assert error_of({"prompt": "x", **body}).param == param


def test_stream_options() -> None:
    request = oai.parse_completion_request(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert request.options.stream and request.options.include_usage
    with pytest.raises(InvalidRequestError):
        oai.parse_completion_request({"prompt": "x"} | {"stream": True, "stream_options": 1})
    nested = error_of({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}})
    assert nested.param == "stream_options.include_usage"
    long = error_of({"prompt": "x", "model": list(range(1000))})
    assert long.param == "model" and len(long.message) < 100


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidRequestError):
        oai.parse_completion_request(["prompt"])
    assert error_of({}).param == "prompt"


# -- chat -------------------------------------------------------------------------------------

def test_chat_request_fields() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = oai.parse_chat_request({
        **CHAT, "max_completion_tokens": 7, "max_tokens": 99, "logprobs": True,
        "top_logprobs": 2, "tools": tools, "tool_choice": "auto",
        "response_format": {"type": "text"}, "chat_template_kwargs": {"flag": True},
        "stream": True, "stream_options": {"include_usage": True}})
    assert request.params.max_tokens == 7  # max_completion_tokens wins
    assert request.params.logprobs == 2
    assert request.tools == tuple(tools)
    assert request.chat_template_kwargs == {"flag": True}
    assert request.add_generation_prompt and not request.continue_final_message
    assert request.options.include_usage
    assert request.messages == tuple(CHAT["messages"])  # type: ignore[arg-type]


def test_chat_defaults() -> None:
    request = oai.parse_chat_request(CHAT)
    assert request.params.max_tokens is None  # whatever the context leaves
    assert request.params.logprobs is None
    assert oai.parse_chat_request({**CHAT, "logprobs": True}).params.logprobs == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": "9"}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
def test_invalid_chat_bodies(body: dict[str, object], param: str) -> None:
    assert error_of({**CHAT, **body}, chat=True).param == param


def test_alias_errors_use_the_request_key() -> None:
    error = error_of({**CHAT, "max_completion_tokens": 0}, chat=True)
    assert "max_completion_tokens" in error.message


# -- responses --------------------------------------------------------------------------------

def test_usage_shape() -> None:
    assert bodies.usage(10, 5, 4) == {"prompt_tokens": 10, "completion_tokens": 5,
                                   "total_tokens": 15,
                                   "prompt_tokens_details": {"cached_tokens": 4}}


def test_completion_logprobs_and_offsets() -> None:
    renderer = FakeRenderer()
    entries = [None, TokenLogprobs(12, -0.5, 1, [(12, -0.5), (3, -1.5)]),
               TokenLogprobs(7, -math.inf, 9, [])]
    out = bodies.completion_logprobs([5, 12, 7], entries, renderer, text_offset=4)
    texts = [renderer.token_text(t) for t in (5, 12, 7)]
    assert out["tokens"] == texts
    assert out["token_logprobs"] == [None, -0.5, -9999.0]
    # As vLLM: each position's top_logprobs hold the token itself, then its alternatives.
    assert out["top_logprobs"] == [None, {"t12": -0.5, "t3": -1.5}, {texts[2]: -9999.0}]
    assert out["text_offset"] == [4, 4 + len(texts[0]), 4 + len(texts[0]) + len(texts[1])]


def test_completion_body_matches_the_openai_client() -> None:
    logprobs = bodies.completion_logprobs([12], [TokenLogprobs(12, -0.1, 1, [(12, -0.1)])],
                                       FakeRenderer())
    body = bodies.completion_response(
        bodies.completion_id(), bodies.created_timestamp(), "m",
        [bodies.completion_choice(0, "hi", "stop", "END", logprobs),
         bodies.completion_choice(1, "yo", "length")], bodies.usage(3, 2, 1))
    parsed = Completion.model_validate(orjson.loads(bodies.dumps(body)))
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert [c.text for c in parsed.choices] == ["hi", "yo"]
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.top_logprobs == [{"t12": -0.1}]
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1


def test_chat_body_and_logprobs_match_the_openai_client() -> None:
    entries = [TokenLogprobs(7, -0.2, 1, [(7, -0.2), (12, -2.0)])]
    body = bodies.chat_response(
        bodies.chat_completion_id(), bodies.created_timestamp(), "m",
        [bodies.chat_choice(0, "hello", "stop", None, bodies.chat_logprobs(entries, FakeRenderer()))],
        bodies.usage(3, 1))
    parsed = ChatCompletion.model_validate(orjson.loads(bodies.dumps(body)))
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.content == "hello"
    assert parsed.choices[0].message.role == "assistant"
    content = parsed.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert content[0].bytes == [0xC3] and content[0].logprob == -0.2
    assert [(t.token, t.bytes) for t in content[0].top_logprobs] == [
        ("\ufffd", [0xC3]), ("t12", list(b"t12"))]


def test_chat_top_logprobs_list_the_sampled_token_first_as_vllm() -> None:
    renderer = FakeRenderer()
    ranked = [(4, -0.5), (9, -1.0), (5, -2.0)]  # the sampled token 5 is third
    outside = [(4, -0.5), (9, -1.0)]  # a sampled token 5 outside the top 2
    content = bodies.chat_logprobs([TokenLogprobs(5, -2.0, 3, ranked),
                                    TokenLogprobs(5, -3.0, 5, outside),
                                    TokenLogprobs(5, -3.0, 5, [])], renderer)["content"]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["t5", "t4", "t9"]
    assert [(t["token"], t["logprob"]) for t in content[1]["top_logprobs"]] == [
        ("t5", -3.0), ("t4", -0.5)]  # k entries in all: the k-th alternative drops out
    assert content[2]["top_logprobs"] == []


def test_stream_chunks_match_the_openai_client() -> None:
    cid, created = bodies.chat_completion_id(), bodies.created_timestamp()
    chunks = [
        bodies.chat_chunk(cid, created, "m", [bodies.chat_delta_choice(0, "", role=True)]),
        bodies.chat_chunk(cid, created, "m", [bodies.chat_delta_choice(0, "Hel")]),
        bodies.chat_chunk(cid, created, "m", [bodies.chat_delta_choice(0, "lo", finish_reason="stop")]),
        bodies.chat_chunk(cid, created, "m", [], bodies.usage(2, 2)),
    ]
    parsed = [ChatCompletionChunk.model_validate(orjson.loads(bodies.sse(c)[6:-2])) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parsed[:3]) == "Hello"
    assert parsed[2].choices[0].finish_reason == "stop"
    assert parsed[3].choices == [] and parsed[3].usage is not None
    assert all(c.object == "chat.completion.chunk" and c.id == cid for c in parsed)
    middle = bodies.completion_chunk("cmpl-1", created, "m", [bodies.completion_choice(0, "Hel", None)])
    assert middle["object"] == "text_completion" and middle["choices"][0]["finish_reason"] is None
    last = bodies.completion_chunk("cmpl-1", created, "m", [bodies.completion_choice(0, "lo", "length")])
    assert Completion.model_validate(last).choices[0].text == "lo"
    assert bodies.sse({"a": 1}) == b'data: {"a":1}\n\n' and bodies.SSE_DONE == b"data: [DONE]\n\n"


def test_prompt_embeds_in_a_completion_body() -> None:
    alone = oai.parse_completion_request({"prompt_embeds": "AAAA"})
    assert alone.prompt_embeds == ("AAAA",) and alone.prompts == ()
    empty_prompt = oai.parse_completion_request({"prompt": "", "prompt_embeds": ["A", "B"]})
    assert empty_prompt.prompt_embeds == ("A", "B") and empty_prompt.prompts == ()
    mixed = oai.parse_completion_request({"prompt": "hi", "prompt_embeds": "A"})
    assert mixed.prompts == ("hi",) and mixed.prompt_embeds == ("A",)
    text_only = oai.parse_completion_request({"prompt": "hi", "prompt_embeds": []})
    assert text_only.prompts == ("hi",) and text_only.prompt_embeds == ()
    for body, param, message in [
            ({"prompt": "", "prompt_embeds": []}, "prompt",
             "Either prompt or prompt_embeds must be provided and non-empty."),
            ({"prompt_embeds": "A", "echo": True}, "echo",
             "Echo is unsupported with prompt embeds."),
            ({"prompt_embeds": "A", "prompt_logprobs": 0}, "prompt_logprobs",
             "prompt_logprobs is not compatible with prompt embeds."),
            ({"prompt_embeds": "A", "suffix": "x"}, "suffix",
             "'suffix' needs text prompts (not token ids or embeddings)"),
            ({"prompt_embeds": [1, 2]}, "prompt_embeds",
             ("'prompt_embeds' must be a base64 string of a torch.save'd tensor, or an "
              "array of them"))]:
        with pytest.raises(InvalidRequestError) as refused:
            oai.parse_completion_request(body)
        assert (refused.value.param, refused.value.message) == (param, message)
