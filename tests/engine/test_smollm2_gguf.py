"""The default model (SmolLM2-135M-Instruct, GGUF) through the engine against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
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


def test_greedy_chat_outputs_match_transformers_on_the_gguf(engine: LLMEngine) -> None:
    tokenizer = load_tokenizer(engine.source)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in QUESTIONS]
    path = engine.source.path
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
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
