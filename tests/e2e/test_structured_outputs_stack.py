"""Structured outputs through the whole mesh, driven by the real `openai` client: with
random weights, every output under a JSON schema parses and validates, and every regex,
choice and grammar output matches, streamed or not, with n > 1."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-so"
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object",
     "properties": {"city": {"type": "string", "pattern": "^[A-Za-z0-9 _-]{1,10}$"},
                    "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
                    "area": {"type": "number", "minimum": 0.5, "maximum": 900}},
     "required": ["city", "population", "area"], "additionalProperties": False},
    {"type": "object",
     "properties": {"order": {"type": "object",
                              "properties": {"id": {"type": "integer", "minimum": 1,
                                                    "maximum": 99},
                                             "status": {"enum": ["new", "paid", "sent"]}},
                              "required": ["id", "status"]},
                    "items": {"type": "array", "minItems": 1, "maxItems": 3,
                              "items": {"type": "object",
                                        "properties": {"sku": {"type": "string",
                                                               "pattern": "^[A-Z0-9]{1,5}$"},
                                                       "qty": {"type": "integer",
                                                               "minimum": 1,
                                                               "maximum": 9}},
                                        "required": ["sku", "qty"]}}},
     "required": ["order", "items"]},
    {"type": "array", "items": {"enum": [1, "two", None, True]}, "minItems": 1,
     "maxItems": 5},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_model(tmp_path_factory.mktemp("so-model"), "llama", seed=23,
                             max_position_embeddings=2048)
    # Sampling defaults for fields a request leaves out (every other test sets its own).
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "temperature": 0.0, "max_new_tokens": 7}))
    config = LauncherConfig(model=str(model), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=512, dtype="float32", device="cpu",
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def streamed_chat_texts(client: openai.OpenAI, **kwargs: Any) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_every_chat_answer_under_a_json_schema_validates(client: openai.OpenAI,
                                                         stream: bool) -> None:
    for i, schema in enumerate(SCHEMAS):
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": f"give me #{i}"}],
                      "n": 3, "temperature": 1.0, "seed": i, "max_tokens": 600,
                      "response_format": json_schema_format(schema)}
        if stream:
            texts = list(streamed_chat_texts(client, **kwargs).values())
        else:
            answer = client.chat.completions.create(**kwargs)
            assert [c.finish_reason for c in answer.choices] == ["stop"] * 3
            texts = [c.message.content or "" for c in answer.choices]
        assert len(texts) == 3
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_guided_json_on_completions(client: openai.OpenAI) -> None:
    cases = [
        ({"structured_outputs": {"regex": r"[a-z]{3}@[a-z]{2,4}\.(com|org)"}},
         re.compile(r"[a-z]{3}@[a-z]{2,4}\.(com|org)")),
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}},
         re.compile(r"alpha|beta|gamma delta")),
        ({"structured_outputs": {"grammar": 'root ::= "[" item ("," item)* "]"\n'
                                            'item ::= [0-9] | "x"'}},
         re.compile(r"\[([0-9]|x)(,([0-9]|x))*\]")),
        ({"guided_regex": r"\d{2}:\d{2}"}, re.compile(r"\d{2}:\d{2}")),
    ]
    for extra, pattern in cases:
        answer = client.completions.create(model=MODEL, prompt="answer:", n=2, max_tokens=80,
                                           temperature=1.0, seed=3, extra_body=extra)
        for choice in answer.choices:
            assert choice.finish_reason == "stop" and pattern.fullmatch(choice.text), (
                extra, choice.text)
        streamed: dict[int, str] = {}
        for chunk in client.completions.create(model=MODEL, prompt="answer:", n=2,
                                               max_tokens=80, temperature=1.0, seed=3,
                                               extra_body=extra, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        assert streamed == {c.index: c.text for c in answer.choices}  # same seed


def test_json_object_mode_answers_with_a_json_object(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json please"}], temperature=0,
        max_tokens=600, response_format={"type": "json_object"},
        extra_body={"structured_outputs": None})
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # a random model may write one long object; what it wrote is a prefix of one
        assert (choice.message.content or "").lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_schema_is_a_400_naming_the_field(client: openai.OpenAI,
                                                     stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=stream,
            response_format=json_schema_format({"type": "object", "properties": 5}))
    assert "JSON schema" in refused.value.message
    assert refused.value.body["param"] == "structured_outputs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as regex_refused:
        client.completions.create(model=MODEL, prompt="x", stream=stream,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert "regular expression" in regex_refused.value.message
    # The stack serves on.
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bad_words_change_the_output_and_a_wrong_shape_is_refused(
        client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="once", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    # Runs of plain letters (random weights also write bytes that are not UTF-8).
    words = re.findall(r"[A-Za-z]{3,}", free.choices[0].text)
    assert words
    banned = client.completions.create(model=MODEL, prompt="once", max_tokens=24,
                                       temperature=0,
                                       extra_body={"ignore_eos": True,
                                                   "bad_words": words})
    assert banned.choices[0].text != free.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="once", extra_body={"bad_words": [3]})
    assert refused.value.body["param"] == "bad_words"  # type: ignore[index]


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def streamed_message(client: openai.OpenAI, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Each choice's streamed deltas put back together: content, tool calls, finish."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            message = out.setdefault(choice.index, {"content": "", "calls": {}})
            message["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                known = message["calls"].setdefault(call.index, {"arguments": ""})
                if call.id:
                    assert "id" not in known and call.type == "function"
                    known["id"], known["name"] = call.id, call.function.name
                known["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                message["finish"] = choice.finish_reason
    return out


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_tool_choice_always_gives_valid_calls(client: openai.OpenAI,
                                                         parallel: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
        # Room for many calls: a random model decides how many, ~70 tokens each here.
        "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 1400}
    answer = client.chat.completions.create(**kwargs)
    streamed = streamed_message(client, **kwargs)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # vLLM
        calls = choice.message.tool_calls or []
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments),
                                PARAMETERS[call.function.name])
        again = streamed[choice.index]
        assert again["finish"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(again["calls"].items())] == [
            (c.function.name, c.function.arguments) for c in calls]


def test_a_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "add 2 and 3"}],
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
        "n": 2, "temperature": 1.0, "seed": 4, "max_tokens": 400}
    answer = client.chat.completions.create(**kwargs)
    streamed = streamed_message(client, **kwargs)
    for choice in answer.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "stop" and len(calls) == 1
        assert calls[0].function.name == "add"
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS["add"])
        again = streamed[choice.index]
        assert list(again["calls"]) == [0] and again["calls"][0]["name"] == "add"
        assert again["calls"][0]["arguments"] == calls[0].function.arguments


def test_tool_choice_errors_name_the_field(client: openai.OpenAI) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    # (tool_choice "required" with a response_format is served, as vLLM serves it:
    # tests/e2e/test_tool_calls.py.)
    for extra in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                  {"tool_choice": "auto"}):  # no parser configured on this stack
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**base, **extra)  # type: ignore[arg-type]
        assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
    # Tools without a tool_choice and without a parser: plain text, as before.
    plain = client.chat.completions.create(**base, max_tokens=4)  # type: ignore[arg-type]
    assert plain.choices[0].message.tool_calls is None


def test_the_models_generation_config_fills_what_a_request_leaves_out(
        client: openai.OpenAI) -> None:
    # temperature 0 from generation_config.json: different seeds, same (greedy) text.
    texts = {client.completions.create(model=MODEL, prompt="hello", max_tokens=12, seed=seed,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for seed in (1, 2, 3)}
    assert len(texts) == 1
    sampled = {client.completions.create(model=MODEL, prompt="hello", max_tokens=12,
                                         seed=seed, temperature=1.0,
                                         extra_body={"ignore_eos": True}).choices[0].text
               for seed in (1, 2, 3)}
    assert len(sampled) > 1  # the request's own temperature wins
    # max_new_tokens caps the default output length.
    capped = client.chat.completions.create(model=MODEL, extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": "hi"}])
    assert capped.usage is not None and capped.usage.completion_tokens == 7


def test_suffix_on_a_model_without_fim_tokens_is_a_400_saying_why(
        client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="def f():", suffix="return 1",
                                  max_tokens=4)
    assert refused.value.body["param"] == "suffix"  # type: ignore[index]
    assert "fill-in-the-middle" in refused.value.message


def test_the_responses_api_answers_streams_stores_and_continues(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Name a city.", max_output_tokens=6,
                                    instructions="Be short.", temperature=0)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete" and first.incomplete_details is not None
    assert first.usage is not None and first.usage.output_tokens == 6
    text = first.output_text
    assert text and client.responses.retrieve(first.id).output_text == text
    events = list(client.responses.create(model=MODEL, input="Name a city.",
                                          max_output_tokens=6, instructions="Be short.",
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [i for i, kind in enumerate(kinds) if kind == "response.output_text.delta"]
    assert len(deltas) > 1  # the text streams as it is generated
    assert kinds.index("response.content_part.added") < deltas[0]
    assert deltas[-1] < kinds.index("response.output_text.done") < kinds.index(
        "response.output_item.done")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    # Continuing: the stored conversation comes before the new input.
    fresh = client.responses.create(model=MODEL, input="And another?", max_output_tokens=2)
    more = client.responses.create(model=MODEL, input="And another?", max_output_tokens=2,
                                   previous_response_id=first.id)
    assert more.usage is not None and fresh.usage is not None
    assert more.usage.input_tokens > fresh.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "high"})
    assert refused.value.body["param"] == "reasoning"  # type: ignore[index]


def test_the_responses_api_returns_function_calls(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    answer = client.responses.create(model=MODEL, input="add 1 and 2", tools=tools,
                                     tool_choice={"type": "function", "name": "add"},
                                     max_output_tokens=400, temperature=1.0)
    [call] = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS["add"])
    # The call's output goes back as an input item.
    after = client.responses.create(model=MODEL, previous_response_id=answer.id,
                                    max_output_tokens=3, input=[{
                                        "type": "function_call_output",
                                        "call_id": call.call_id, "output": "3"}])
    assert after.status in ("completed", "incomplete")


def test_return_token_ids_gives_prompt_and_output_ids(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="hello there", max_tokens=5,
                                       temperature=0, extra_body={"return_token_ids": True,
                                                                  "ignore_eos": True})
    choice = answer.choices[0].model_dump()
    tokens = client.post("/../tokenize", cast_to=object,
                         body={"model": MODEL, "prompt": "hello there"})
    assert choice["prompt_token_ids"] == tokens["tokens"]  # type: ignore[index]
    assert len(choice["token_ids"]) == 5
    streamed: list[int] = []
    prompt_ids = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0, stream=True, extra_body={"return_token_ids": True,
                                                    "ignore_eos": True}):
        if (chunk.model_extra or {}).get("prompt_token_ids"):  # on the role chunk (vLLM)
            prompt_ids.append(chunk.model_extra["prompt_token_ids"])  # type: ignore[index]
        for c in chunk.choices:
            streamed += c.model_dump().get("token_ids") or []
    assert len(streamed) == 5 and len(prompt_ids) == 1 and prompt_ids[0]
