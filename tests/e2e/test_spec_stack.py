"""Speculative decoding through the whole mesh: a stack started with vLLM's
--speculative-config answers greedy requests, streamed or not, with the very tokens and
text of transformers' greedy decoding, and its worker exports vLLM's spec_decode counters."""

from __future__ import annotations

import random
import re
import urllib.request

import openai
import pytest
import torch
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshserve.cli.vllm_options import translate
from meshserve.local.launcher import LauncherConfig, start_stack

MODEL = "tiny-spec"
MAX_NEW = 24


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("spec-model"), "llama", seed=31)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory: pytest.TempPathFactory):
    # The flag as `vllm serve` spells it, through the same translation `meshserve serve` uses.
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    argv = translate(["--speculative-config", spec])
    assert argv == ["--speculative-config", spec]
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=256, dtype="float32", device="cpu",
                            speculative_config=spec,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def expected(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(9)
    loop = [rng.randrange(3, 400) for _ in range(5)]
    prompts = [loop * 5, [rng.randrange(3, 400) for _ in range(12)]]
    return [(p, ids, tokenizer.decode(ids)) for p in prompts
            for ids in [hf_greedy(hf, p, MAX_NEW)]]


def test_greedy_text_is_that_of_decoding_without_drafts(stack, expected) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
    for prompt, ids, text in expected:
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = reply.choices[0]
        assert choice.token_ids == ids  # type: ignore[attr-defined]
        assert choice.text == text
        assert reply.usage is not None and reply.usage.completion_tokens == MAX_NEW
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices)
        assert streamed == text


def test_worker_exports_vllm_spec_decode_counters(stack, expected) -> None:
    (worker,) = [s for s in stack.services if s.role == "worker"]
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
    client.completions.create(model=MODEL, prompt=expected[0][0], max_tokens=MAX_NEW,
                              temperature=0.0, extra_body={"ignore_eos": True})
    with urllib.request.urlopen(worker.metrics_url, timeout=10) as response:
        text = response.read().decode()

    def value(name: str, extra: str = "") -> float:
        match = re.search(rf'^vllm:spec_decode_{name}_total\{{model_name="{MODEL}"{extra}\}} '
                          r"([0-9.e+]+)$", text, re.MULTILINE)
        assert match, f"{name} missing from the worker's /metrics"
        return float(match.group(1))

    drafts, drafted, accepted = (value(n) for n in
                                 ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    per_pos = [value("num_accepted_tokens_per_pos", f',position="{j}"') for j in range(4)]
    assert drafts > 0 and 0 < accepted <= drafted <= 4 * drafts
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)
