"""Prompts given as embeddings (--enable-prompt-embeds) against transformers.

A tiny random-weight Llama (tests/tiny_models.py) in float32: the engine's greedy tokens and
their logprobs from prompt embeddings equal transformers' `generate(inputs_embeds=...)` and
its log-softmax; the model's own embedding rows for some ids give the token prompt's answer;
the prefix cache reuses the blocks of repeated embeddings and never those of other ones.
Embeddings reach the engine as the worker's wire gives them (services/worker/serving/wire.py:
a Prompt with its PromptEmbeds), read from a `torch.save` file by shared/prompt_embeds.py.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.proto.v1 import worker_pb2
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.services.worker.serving.wire import prompt_images
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.prompt_embeds import DISABLED_MESSAGE, load_prompt_embeds
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


@pytest.fixture(scope="module")
def engine(setup: tuple[Path, torch.nn.Module]) -> LLMEngine:
    return _engine(setup[0], enable_prompt_embeds=True)


def _engine(folder: Path, **overrides: object) -> LLMEngine:
    cfg: dict[str, object] = {"model": str(folder), "dtype": "float32", "device": "cpu",
                              "block_size": 16, "num_kv_blocks": 128,
                              "max_num_batched_tokens": 24}  # prompts prefill in chunks
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def _saved(rows: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _add(engine: LLMEngine, request_id: str, rows: torch.Tensor,
         params: SamplingParams = GREEDY) -> None:
    """Add a prompt of `rows` [S, H] the way the worker's session does."""
    embeds = load_prompt_embeds(_saved(rows))
    prompt = worker_pb2.Prompt(token_ids=[0] * embeds.rows, embeds=worker_pb2.PromptEmbeds(
        data=embeds.data, dtype=embeds.dtype, hash=embeds.digest))
    engine.add_request(request_id, list(prompt.token_ids), params,
                       images=prompt_images(prompt))


def _run(engine: LLMEngine) -> dict[str, list[SequenceOutput]]:
    outputs: dict[str, list[SequenceOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _tokens(outs: list[SequenceOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _random_rows(hf: torch.nn.Module, length: int, seed: int) -> torch.Tensor:
    """Rows of the embedding matrix's scale that are no token's embedding."""
    scale = hf.get_input_embeddings().weight.std().item()
    return torch.randn(length, hf.config.hidden_size,
                       generator=torch.Generator().manual_seed(seed)) * scale


def _hf_greedy(hf: torch.nn.Module, rows: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from `rows` and the log-softmax [MAX_NEW, V] of each step."""
    with torch.no_grad():
        out = hf.generate(inputs_embeds=rows[None], attention_mask=torch.ones(1, len(rows)),
                          max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    scores = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])
    return out.sequences[0, -MAX_NEW:].tolist(), scores


@pytest.mark.parametrize("length", [1, 7, 40])
def test_embeddings_match_transformers_inputs_embeds(setup, engine: LLMEngine,
                                                     length: int) -> None:
    _, hf = setup
    rows = _random_rows(hf, length, seed=length)
    expected, scores = _hf_greedy(hf, rows)
    _add(engine, f"e{length}", rows)
    outs = _run(engine)[f"e{length}"]
    assert _tokens(outs) == expected
    assert outs[-1].num_prompt_tokens == length
    logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(logprobs) == MAX_NEW
    for k, lp in enumerate(logprobs):
        assert lp.token_id == expected[k]
        assert abs(lp.logprob - scores[k, expected[k]].item()) < 1e-4


def test_own_embedding_rows_answer_as_the_token_prompt(setup, engine: LLMEngine) -> None:
    _, hf = setup
    ids = [5 + (i * 37) % 200 for i in range(21)]
    rows = hf.get_input_embeddings().weight[ids].detach()
    engine.add_request("ids", ids, GREEDY)
    by_ids = _run(engine)["ids"]
    _add(engine, "rows", rows)
    by_rows = _run(engine)["rows"]
    assert _tokens(by_rows) == _tokens(by_ids)
    for a, b in zip([lp for o in by_rows for lp in o.new_logprobs or []],
                    [lp for o in by_ids for lp in o.new_logprobs or []], strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4
    assert by_rows[-1].num_cached_tokens == 0, "embeddings never share the token prompt's blocks"


def test_bfloat16_and_float16_rows_become_the_models_dtype(setup, engine: LLMEngine) -> None:
    _, hf = setup
    rows = _random_rows(hf, 9, seed=99)
    for dtype in (torch.bfloat16, torch.float16):
        expected, _ = _hf_greedy(hf, rows.to(dtype).float())
        _add(engine, "half", rows.to(dtype))
        assert _tokens(_run(engine)["half"]) == expected


def test_prefix_cache_hits_repeated_embeddings_only(setup, engine: LLMEngine) -> None:
    _, hf = setup
    rows = _random_rows(hf, 40, seed=1234)  # two full blocks of 16, then 8 rows
    other = rows.clone()
    other[-1] += 1.0  # differs in its last (partial) block only
    changed_first = rows.clone()
    changed_first[0] += 1.0  # differs in the first block: nothing may be shared
    _add(engine, "first", rows)
    first = _run(engine)["first"]
    _add(engine, "again", rows)
    again = _run(engine)["again"]
    assert again[-1].num_cached_tokens == 32
    assert _tokens(again) == _tokens(first)
    # The digest covers the whole tensor: even rows equal in the first blocks are other KV.
    _add(engine, "other", other)
    assert _run(engine)["other"][-1].num_cached_tokens == 0
    _add(engine, "changed", changed_first)
    changed = _run(engine)["changed"]
    assert changed[-1].num_cached_tokens == 0
    assert _tokens(changed) == _hf_greedy(hf, changed_first)[0]


def test_refusals(setup, engine: LLMEngine) -> None:
    folder, hf = setup
    rows = _random_rows(hf, 4, seed=5)
    with pytest.raises(InvalidRequestError, match="hidden size 64"):
        _add(engine, "wide", torch.zeros(4, 2 * hf.config.hidden_size))
    embeds = load_prompt_embeds(_saved(rows))
    forged = worker_pb2.Prompt(token_ids=[0] * 4, embeds=worker_pb2.PromptEmbeds(
        data=embeds.data, dtype=embeds.dtype, hash=bytes(32)))
    with pytest.raises(InvalidRequestError, match="hash"):
        engine.add_request("forged", [0] * 4, GREEDY, images=prompt_images(forged))
    plain = _engine(folder)
    with pytest.raises(InvalidRequestError, match="enable-prompt-embeds") as refused:
        _add(plain, "off", rows)
    assert refused.value.message == DISABLED_MESSAGE
    assert not engine.has_unfinished_requests() and not plain.has_unfinished_requests()
