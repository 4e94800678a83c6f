"""`prompt_embeds` on /v1/completions through the whole mesh, with the real `openai` client.

One stack for the module, started as `meshserve up --enable-prompt-embeds` starts it (a tiny
random Llama on the CPU in float32). The prompts are `torch.save`d tensors in base64, as
vLLM's documentation sends them: the model's own embedding rows for some token ids answer
as those ids do; usage counts one prompt token a row and nothing of the prompt is echoed;
streams, batches and a batch mixing embeddings with text (embeddings first, as vLLM);
repeated embeddings hit the prefix cache and different ones do not; and vLLM's refusals
(echo, prompt_logprobs), with the gateway's and the worker's for what is not a tensor, a
wrong hidden size and too many rows. The flag off is refused by tests/e2e's shapes stack.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-embeds"
MAX_MODEL_LEN = 96
IDS = [11, 42, 7, 99, 150, 23, 64, 5, 180, 33, 71, 2, 120, 88, 19, 140, 57, 9, 201, 76]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=9)


@pytest.fixture(scope="module")
def table(model_dir: Path) -> torch.Tensor:
    """The model's embedding matrix [V, H]."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf.get_input_embeddings().weight.detach().clone()


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = LauncherConfig.from_args(
        ["--model", str(model_dir), "--served-model-name", MODEL, "--port", "0",
         "--num-kv-blocks", "64", "--dtype", "float32", "--device", "cpu", "--no-kvstore",
         "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-embeds",
         "--run-dir", str(tmp_path_factory.mktemp("run")), "--startup-timeout-s", "300",
         "--stop-grace-s", "10"], environ={})
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def encoded(rows: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def complete(client: openai.OpenAI, prompt: Any = "", **body: Any) -> Any:
    extra = {key: body.pop(key) for key in ("prompt_embeds", "prompt_logprobs", "ignore_eos")
             if key in body}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0,
                                     extra_body={"ignore_eos": True, **extra}, **body)


def refusal(call: Any) -> str:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.body["message"]  # type: ignore[index]


def test_own_embedding_rows_answer_as_their_tokens(client: openai.OpenAI,
                                                   table: torch.Tensor) -> None:
    by_ids = complete(client, IDS, logprobs=2)
    by_rows = complete(client, prompt_embeds=encoded(table[IDS]), logprobs=2)
    choice = by_rows.choices[0]
    assert choice.text == by_ids.choices[0].text and choice.text
    assert choice.logprobs.tokens == by_ids.choices[0].logprobs.tokens
    for a, b in zip(choice.logprobs.token_logprobs, by_ids.choices[0].logprobs.token_logprobs,
                    strict=True):
        assert abs(a - b) < 1e-4
    assert by_rows.usage.prompt_tokens == len(IDS)
    assert by_rows.usage.completion_tokens == 6
    ids_asked = client.post("/completions", cast_to=object, body={  # type: ignore[call-overload]
        "model": MODEL, "prompt": "", "prompt_embeds": encoded(table[IDS]), "max_tokens": 2,
        "return_token_ids": True, "ignore_eos": True})["choices"][0]
    assert ids_asked["prompt_token_ids"] is None and len(ids_asked["token_ids"]) == 2
    bf16 = complete(client, prompt_embeds=encoded(table[IDS].to(torch.bfloat16)[None]))
    assert bf16.usage.prompt_tokens == len(IDS)  # [1, S, H]: a batch of one, as vLLM takes it


def test_streams_batches_and_mixed_prompts(client: openai.OpenAI, table: torch.Tensor) -> None:
    first, second = encoded(table[IDS]), encoded(table[IDS[::-1]])
    alone = [complete(client, prompt_embeds=e).choices[0].text for e in (first, second)]
    text_only = complete(client, "the quick brown fox").choices[0].text
    stream = complete(client, prompt_embeds=[first, second], stream=True)
    streamed = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == alone
    batch = complete(client, prompt_embeds=[first, second])
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    assert batch.usage.prompt_tokens == 2 * len(IDS)
    mixed = complete(client, "the quick brown fox", prompt_embeds=first)
    texts = [c.text for c in sorted(mixed.choices, key=lambda c: c.index)]
    assert texts == [alone[0], text_only]  # the embeddings first


def test_prefix_cache_keys_on_the_embeddings(client: openai.OpenAI, table: torch.Tensor) -> None:
    rows = torch.randn(40, table.shape[1], generator=torch.Generator().manual_seed(3)) * 0.05
    first = complete(client, prompt_embeds=encoded(rows))
    again = complete(client, prompt_embeds=encoded(rows))
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # its two full blocks
    changed = rows.clone()
    changed[0, 0] += 0.5  # the same rows past the first: still other KV from the first on
    other = complete(client, prompt_embeds=encoded(changed))
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_refusals(client: openai.OpenAI, table: torch.Tensor) -> None:
    rows = encoded(table[IDS])
    assert refusal(lambda: complete(client, prompt_embeds=rows, echo=True)) == (
        "Echo is unsupported with prompt embeds.")
    assert refusal(lambda: complete(client, prompt_embeds=rows, prompt_logprobs=1)) == (
        "prompt_logprobs is not compatible with prompt embeds.")
    assert "not valid base64" in refusal(lambda: complete(client, prompt_embeds="not base64!"))
    saved_dict = io.BytesIO()
    torch.save({"rows": table[IDS]}, saved_dict)
    not_tensor = base64.b64encode(saved_dict.getvalue()).decode()
    assert "not a tensor" in refusal(lambda: complete(client, prompt_embeds=not_tensor))
    ints = encoded(torch.zeros(4, table.shape[1], dtype=torch.int64))
    assert "float32, bfloat16 or float16" in refusal(
        lambda: complete(client, prompt_embeds=ints))
    wide = encoded(torch.zeros(4, 2 * table.shape[1]))
    assert f"hidden size {table.shape[1]}" in refusal(
        lambda: complete(client, prompt_embeds=wide))
    long = encoded(torch.zeros(MAX_MODEL_LEN + 1, table.shape[1]))
    assert f"maximum context length is {MAX_MODEL_LEN}" in refusal(
        lambda: complete(client, prompt_embeds=long))
    assert "must be provided" in refusal(lambda: complete(client, "", prompt_embeds=[]))
    # The stack still answers after every refusal.
    assert complete(client, prompt_embeds=rows).choices[0].text
