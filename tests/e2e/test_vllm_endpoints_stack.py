"""vLLM's extra endpoints and flags through the whole mesh, with real HTTP: /tokenizer_info
(--enable-tokenizer-info-endpoint), /load (--enable-server-load-tracking), X-Request-Id on
every response (--enable-request-id-headers), SageMaker's /ping and /invocations, the
batch chat endpoint /v1/chat/completions/batch, and beam search (use_beam_search).

One stack for the module (tiny random Llama on the CPU); every test is a few requests.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

MODEL = "tiny-endpoints"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=5)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=64, dtype="float32", device="cpu", kvstore=False,
                            max_model_len=128, enable_tokenizer_info_endpoint=True,
                            enable_server_load_tracking=True, enable_request_id_headers=True,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


def call(stack, method: str, path: str, body: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request to the gateway."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(stack.gateway_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_tokenizer_info_is_the_tokenizers_configuration(stack, model_dir: Path) -> None:
    status, _, raw = call(stack, "GET", "/tokenizer_info")
    assert status == 200, raw
    info = json.loads(raw)
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert info["tokenizer_class"] == type(hf).__name__
    assert "vocab_file" not in info and "merges_file" not in info
    assert info["eos_token"] == hf.eos_token
    assert info["model_max_length"] == hf.model_max_length
    added = info.get("added_tokens_decoder", {})
    assert all(isinstance(text, str) for text in added.values())  # tokens as their text


def test_load_counts_requests_in_flight(stack) -> None:
    assert json.loads(call(stack, "GET", "/load")[2]) == {"server_load": 0}
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
    # Long enough that the stream is still generating when /load is read after its first
    # chunk (the handler ends once it has written the last one, read or not).
    with client.completions.create(model=MODEL, prompt="hello", max_tokens=110, stream=True,
                                   extra_body={"ignore_eos": True}) as stream:
        next(iter(stream))
        assert json.loads(call(stack, "GET", "/load")[2]) == {"server_load": 1}
        list(stream)
    assert json.loads(call(stack, "GET", "/load")[2]) == {"server_load": 0}


def test_every_response_carries_a_request_id(stack) -> None:
    _, headers, _ = call(stack, "GET", "/health", headers={"X-Request-Id": "mine-1"})
    assert headers["X-Request-Id"] == "mine-1"
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/nowhere")):
        _, headers, _ = call(stack, method, path)
        assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]), (path, headers)
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "chat-7"})
    assert raw.headers["x-request-id"] == "chat-7"


def test_ping_answers_get_and_post(stack) -> None:
    assert call(stack, "GET", "/ping")[0] == 200
    assert call(stack, "POST", "/ping")[0] == 200


def test_invocations_dispatch_on_the_body(stack) -> None:
    status, _, raw = call(stack, "POST", "/invocations", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert status == 200 and json.loads(raw)["object"] == "chat.completion", raw
    status, _, raw = call(stack, "POST", "/invocations",
                          {"model": MODEL, "prompt": "once upon", "max_tokens": 3})
    assert status == 200 and json.loads(raw)["object"] == "text_completion", raw
    status, _, raw = call(stack, "POST", "/invocations", {"model": MODEL, "input": "hi"})
    assert status == 400, raw  # the embeddings endpoint's answer: no pooling worker
    status, _, raw = call(stack, "POST", "/invocations", {"model": MODEL, "text": "hi"})
    assert status == 400
    assert "Cannot find suitable handler" in json.loads(raw)["error"]["message"]


def test_batch_chat_answers_each_conversation_as_chat_does(stack) -> None:
    conversations = [[{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "once upon a time"}]]
    alone = []
    for messages in conversations:
        status, _, raw = call(stack, "POST", "/v1/chat/completions", {
            "model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, raw
        alone.append(json.loads(raw))
    status, _, raw = call(stack, "POST", "/v1/chat/completions/batch", {
        "model": MODEL, "messages": conversations, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "stream": True})  # vLLM ignores stream here: one JSON body
    assert status == 200, raw
    batch = json.loads(raw)
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for choice, single in zip(batch["choices"], alone, strict=True):
        assert choice["message"]["content"] == single["choices"][0]["message"]["content"]
        assert choice["finish_reason"] == "length"
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][field] == sum(a["usage"][field] for a in alone)
    assert alone[0]["usage"]["prompt_tokens"] != alone[1]["usage"]["prompt_tokens"]
    status, _, raw = call(stack, "POST", "/v1/chat/completions/batch", {
        "model": MODEL, "messages": conversations, "n": 2})
    assert status == 400 and "do not support `n > 1`" in json.loads(raw)["error"]["message"]
    status, _, raw = call(stack, "POST", "/v1/chat/completions/batch", {
        "model": MODEL, "messages": [conversations[0], []]})
    assert status == 400, raw
    status, _, raw = call(stack, "POST", "/v1/chat/completions/batch", {
        "model": MODEL, "messages": conversations, "max_tokens": 0})
    assert status == 400, raw  # a conversation's own error is the batch's


def engine_beams(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The beams an engine of its own (the worker's code, in this process) answers."""
    engine = build_engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                       num_kv_blocks=64))
    engine.add_request("beams", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return [o.new_token_ids for o in sorted(outputs, key=lambda o: o.index)]


def test_beam_search_answers_the_engines_beams(stack, model_dir: Path) -> None:
    """use_beam_search with n=3 through the mesh: three choices, the engine's beams best
    first, whole or streamed, completions and chat; usage counts every choice's tokens."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer("once upon a time", add_special_tokens=False)["input_ids"]
    beams = engine_beams(model_dir, prompt, SamplingParams(n=3, max_tokens=6,
                                                           use_beam_search=True))
    texts = [tokenizer.decode(b, skip_special_tokens=True) for b in beams]
    assert len(set(map(tuple, beams))) == 3, "three different beams"
    extra = {"use_beam_search": True, "length_penalty": 1.0, "early_stopping": False}
    answer = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6,
                                       logprobs=1, extra_body=extra)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == texts
    assert all(c.logprobs is not None and len(c.logprobs.tokens or []) == len(b)
               for c, b in zip(answer.choices, beams, strict=True))
    assert answer.usage is not None
    assert answer.usage.completion_tokens == sum(len(b) for b in beams)
    assert answer.usage.prompt_tokens == len(prompt)
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6,
                                           stream=True, extra_body=extra):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    messages = [{"role": "user", "content": "hi"}]
    chat_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
    chat_prompt = tokenizer(chat_text, add_special_tokens=False)["input_ids"]
    chat_beams = engine_beams(model_dir, chat_prompt,
                              SamplingParams(n=3, max_tokens=5, use_beam_search=True))
    chat = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          n=3, max_tokens=5, extra_body=extra)
    assert [c.message.content for c in chat.choices] == [
        tokenizer.decode(b, skip_special_tokens=True) for b in chat_beams]
    assert chat.usage is not None
    assert chat.usage.completion_tokens == sum(len(b) for b in chat_beams)
