"""The default model (SmolLM2-135M-Instruct, GGUF) against transformers on the same file: its
logits through the paged model, and greedy chats through the engine (transformers' GGUF load,
the slow part, is shared)."""

from __future__ import annotations

import pytest
import torch
from test_models import CPU, PagedRunner, token_ids
from transformers import AutoModelForCausalLM

from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.loader import (
    ModelSource,
    load_model,
    load_model_config,
    resolve_model,
)
from meshserve.shared.default_model import DEFAULT_MODEL_NAME
from meshserve.shared.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the moon.",
    "List three colours.",
    "日本の首都はどこですか？",
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return build_engine(EngineConfig(model=None, dtype="float32", device="cpu",
                                  max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def hf(engine: LLMEngine) -> torch.nn.Module:
    """transformers' model from the same GGUF file."""
    path = engine.source.path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def test_default_gguf_model_matches_transformers(hf: torch.nn.Module) -> None:
    source = resolve_model(None)
    assert source.format == "gguf" and source.name == DEFAULT_MODEL_NAME
    assert resolve_model(str(source.path)) == ModelSource(str(source.path), source.path, "gguf",
                                                          source.path)
    ours = load_model(source, load_model_config(source), torch.float32, CPU, "auto")
    assert ours.config.architecture == "LlamaForCausalLM" and ours.config.tie_word_embeddings
    ids = torch.cat([torch.tensor([1]), token_ids(13, seed=9, vocab=ours.config.vocab_size)])
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    runner = PagedRunner(ours, num_blocks=8, block_size=16)
    prefill = runner.step([(0, ids[:12], 0)])[0]
    decode = [runner.step([(0, ids[t : t + 1], t)])[0] for t in (12, 13)]
    torch.testing.assert_close(torch.cat([prefill, *decode]), want, rtol=0, atol=1e-3)


def test_greedy_chat_outputs_match_transformers_on_the_gguf(engine: LLMEngine,
                                                            hf: torch.nn.Module) -> None:
    tokenizer = load_tokenizer(engine.source)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in QUESTIONS]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, want in enumerate(expected):
        assert got[f"q{i}"] == want, f"question {i}: {tokenizer.decode(got[f'q{i}'])!r}"
    assert "Paris" in tokenizer.decode(got["q0"])
