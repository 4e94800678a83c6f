"""Response shapes, logprobs, streaming usage, chat fields and error texts as vLLM's OpenAI
server gives them, through the whole mesh with the real `openai` client.

One stack for the module (tiny random Llama on the CPU, --max-logprobs -1 so that -1 may ask
for the whole vocabulary); every test is a few short requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-shapes"
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=5)


@pytest.fixture(scope="module")
def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=64, dtype="float32", device="cpu", kvstore=False,
                            max_model_len=128, max_logprobs=-1,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def raw(client: openai.OpenAI, path: str, **body: Any) -> dict[str, Any]:
    """The JSON body of a POST, as the server wrote it."""
    return client.post(path, cast_to=object, body={"model": MODEL, **body})  # type: ignore


def bad_request(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.body  # type: ignore[return-value]


def test_response_shapes(client: openai.OpenAI, tokenizer) -> None:
    ids = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    plain = raw(client, "/completions", prompt=ids, max_tokens=2)
    choice = plain["choices"][0]
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None
    assert choice["token_ids"] is None
    asked = raw(client, "/completions", prompt=ids, max_tokens=3, return_token_ids=True,
                ignore_eos=True)["choices"][0]
    assert asked["prompt_token_ids"] == ids and len(asked["token_ids"]) == 3
    chat = raw(client, "/chat/completions", messages=USER, max_tokens=3, prompt_logprobs=1,
               return_token_ids=True, ignore_eos=True)
    assert "prompt_logprobs" not in chat["choices"][0]  # top level, as vLLM
    prompt_ids = chat["prompt_token_ids"]
    assert prompt_ids and len(chat["prompt_logprobs"]) == len(prompt_ids)
    assert chat["prompt_logprobs"][0] is None and str(prompt_ids[1]) in chat["prompt_logprobs"][1]
    assert len(chat["choices"][0]["token_ids"]) == 3
    plain_chat = raw(client, "/chat/completions", messages=USER, max_tokens=1)
    assert plain_chat["prompt_logprobs"] is None and plain_chat["prompt_token_ids"] is None


def test_streamed_token_ids(client: openai.OpenAI, tokenizer) -> None:
    ids = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    streamed, prompts = [], []
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=4, stream=True,
                                           extra_body={"return_token_ids": True,
                                                       "ignore_eos": True}):
        for c in chunk.choices:
            extra = c.model_extra or {}
            streamed += extra.get("token_ids") or []
            if extra.get("prompt_token_ids"):
                prompts.append(extra["prompt_token_ids"])
    assert len(streamed) == 4 and prompts == [ids]
    chat_ids, chat_prompts = [], []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}):
        if (chunk.model_extra or {}).get("prompt_token_ids"):  # on the role chunk
            assert chunk.choices[0].delta.role == "assistant"
            chat_prompts.append(chunk.model_extra["prompt_token_ids"])  # type: ignore[index]
        for c in chunk.choices:
            chat_ids += (c.model_extra or {}).get("token_ids") or []
    assert len(chat_ids) == 4 and len(chat_prompts) == 1


def test_logprobs(client: openai.OpenAI, tokenizer, vocab_size: int) -> None:
    zero = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, logprobs=0,
                                     temperature=0).choices[0].logprobs
    assert zero is not None and zero.top_logprobs is not None
    for token, top in zip(zero.tokens or [], zero.top_logprobs, strict=True):
        assert list(top) == [token]  # the sampled token itself
    ids = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                       logprobs=1, temperature=0).choices[0].logprobs
    assert echoed is not None and echoed.top_logprobs is not None
    assert echoed.top_logprobs[0] is None
    for position in range(1, len(ids)):  # the prompt token among its position's top
        assert echoed.tokens[position] in echoed.top_logprobs[position]  # type: ignore
    whole = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                           logprobs=True, top_logprobs=-1)
    assert len(whole.choices[0].logprobs.content[0].top_logprobs) == vocab_size  # type: ignore
    sampled = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8,
                                             temperature=1.5, seed=3, logprobs=True,
                                             top_logprobs=2).choices[0].logprobs
    for entry in sampled.content:  # type: ignore[union-attr]
        assert len(entry.top_logprobs) == 2  # as vLLM: the sampled token first
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (
            entry.token, entry.logprob)
    prompt = raw(client, "/completions", prompt=ids, max_tokens=1, prompt_logprobs=-1)
    assert all(len(e) >= vocab_size for e in prompt["choices"][0]["prompt_logprobs"][1:])
    coerced = raw(client, "/chat/completions", messages=USER, max_tokens=1, logprobs="true")
    assert coerced["choices"][0]["logprobs"]["content"]


def test_streaming_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is not None for c in chunks)
    assert chunks[0].usage.completion_tokens == 0  # type: ignore[union-attr]
    quiet = list(client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert quiet and all(c.usage is None for c in quiet)
    completions = list(client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert completions and all(c.usage is None for c in completions)


def test_chat_fields(client: openai.OpenAI) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    custom = client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "narrator", "content": "Once"}],
        extra_body={"chat_template": template})
    assert custom.choices[0].message.content is not None
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 2,
                              "extra_body": {"echo": True, "continue_final_message": True,
                                             "add_generation_prompt": False}}
    echoed = client.chat.completions.create(**kwargs)
    assert (echoed.choices[0].message.content or "").startswith("Once upon")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions
                       .create(stream=True, **kwargs) if c.choices)
    assert streamed.startswith("Once upon")
    # A generation prompt answers as the assistant: a user's final message is not echoed.
    unechoed = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                              extra_body={"echo": True})
    assert not (unechoed.choices[0].message.content or "").startswith("Say something.")
    for seed in (2**63, -(2**63) - 1):
        body = bad_request(lambda s=seed: client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1, seed=s))
        assert body["param"] == "seed"
    ok = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, seed=2**63 - 1)
    assert ok.choices


def test_error_texts(client: openai.OpenAI, vocab_size: int) -> None:
    bias = bad_request(lambda: client.completions.create(
        model=MODEL, prompt="hi", max_tokens=1, logit_bias={str(vocab_size): 5}))
    assert bias["message"].startswith(
        f"token_id(s) [{vocab_size}] in logit_bias contain out-of-vocab token ids. "
        f"Vocabulary size: {vocab_size}")
    empty = bad_request(lambda: client.completions.create(model=MODEL, prompt=[],
                                                          max_tokens=1))
    assert empty["message"].startswith("The decoder prompt cannot be empty")
    unknown = bad_request(lambda: client.completions.create(
        model=MODEL, prompt=[1, vocab_size + 7], max_tokens=1))
    assert unknown["message"].startswith(f"Token id {vocab_size + 7} is out of vocabulary")
    # Without --enable-prompt-embeds (tests/e2e/test_prompt_embeds_stack.py turns it on).
    embeds = bad_request(lambda: client.completions.create(
        model=MODEL, prompt="", max_tokens=1, extra_body={"prompt_embeds": "AAAA"}))
    assert embeds["message"] == "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
    assert embeds["param"] == "prompt_embeds"
