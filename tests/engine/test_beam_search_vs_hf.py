"""Beam search in the engine against transformers' `generate(num_beams=...)` on the same weights.

A tiny random-weight Llama (tests/tiny_models.py) in float32, whose EOS ids are rewritten to
two tokens its beams emit (256 and 501), so that some beams end on EOS and others run to
max_tokens. For widths 2 and 4, length penalties 0, 1 and 2 and every early_stopping, the n
outputs are transformers' n returned sequences, in its order, and their scores its
`sequences_scores`; beam requests run batched beside plain greedy requests, which still
match their own reference. The beams share their blocks, and every block is free after.
Offline, a run-batch line with use_beam_search answers the same beams.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import orjson
import pytest
import torch
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshserve.offline.llm import OfflineLLM
from meshserve.offline.run_batch import run_batch
from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams

EOS = [256, 501]  # tokens this model's beams emit (see test_eos_is_reachable)
MAX_NEW = 12
PROMPT_LENGTHS = (5, 17, 30)
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Path, torch.nn.Module, list[list[int]]]:
    folder = build_tiny_model(tmp_path_factory.mktemp("beam"), "llama", seed=1)
    for name, eos in (("config.json", EOS[0]), ("generation_config.json", EOS)):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)]
               for n in PROMPT_LENGTHS]
    return folder, hf, prompts


def make_engine(folder: Path, **overrides: object) -> LLMEngine:
    config: dict[str, object] = {"model": str(folder), "dtype": "float32", "device": "cpu",
                                 "block_size": BLOCK_SIZE, "num_kv_blocks": 256}
    config.update(overrides)
    return build_engine(EngineConfig(**config))  # type: ignore[arg-type]


def hf_beams(hf: torch.nn.Module, prompt: list[int], width: int, length_penalty: float,
             early_stopping: bool | str, eos: bool, max_new: int = MAX_NEW,
             ) -> tuple[list[list[int]], list[float]]:
    """transformers' n best beams (cut after their EOS) and their scores."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          num_beams=width, num_return_sequences=width, do_sample=False,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          eos_token_id=EOS if eos else None, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if eos and t in EOS), len(row))
        beams.append(row[:end])  # (transformers pads after EOS)
    return beams, out.sequences_scores.tolist()


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> tuple[dict[str, list[SequenceOutput]], int]:
    """Run the requests to completion: their outputs, and the most blocks in use at once."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[SequenceOutput]] = {}
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    return outputs, peak


def beam_params(width: int, length_penalty: float, early_stopping: bool | str,
                eos: bool) -> SamplingParams:
    return SamplingParams(n=width, max_tokens=MAX_NEW, use_beam_search=True,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          ignore_eos=not eos, include_stop_str_in_output=True)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINE_SETUPS = {
    "plain": {},
    # The overlapped loop forced on, prompts in chunks of a small step budget.
    "async-chunked": {"async_scheduling": "on", "max_num_batched_tokens": 24},
    # Too few blocks for every beam at once: beams are preempted and computed again.
    "tiny-cache": {"num_kv_blocks": 14, "max_num_batched_tokens": 64},
    # One sequence a step by the cap: a request's beams still run together past it.
    "batch-of-one": {"max_num_seqs": 1},
}


def check_against_hf(engine: LLMEngine, hf: torch.nn.Module, prompts: list[list[int]],
                     width: int, length_penalty: float, early_stopping: bool | str,
                     eos: bool, with_greedy: bool = True) -> list[SequenceOutput]:
    params = beam_params(width, length_penalty, early_stopping, eos)
    requests = {f"beam{i}": (p, params) for i, p in enumerate(prompts)}
    if with_greedy:
        requests.update({f"greedy{i}": (p, GREEDY) for i, p in enumerate(prompts[:2])})
    free_at_start = engine.kv.num_free_blocks
    outputs, _ = run(engine, requests)
    finals: list[SequenceOutput] = []
    for i, prompt in enumerate(prompts):
        want_tokens, want_scores = hf_beams(hf, prompt, width, length_penalty,
                                            early_stopping, eos)
        outs = outputs[f"beam{i}"]
        assert sorted(o.index for o in outs) == list(range(width)), "one output per beam"
        outs.sort(key=lambda o: o.index)
        case = f"prompt {i}, width {width}, lp {length_penalty}, early {early_stopping}"
        assert [o.new_token_ids for o in outs] == want_tokens, case
        got_scores = [o.beam_score for o in outs]
        assert got_scores == pytest.approx(want_scores, abs=1e-4), case
        for out, tokens in zip(outs, want_tokens, strict=True):
            assert out.finish_reason == ("stop" if eos and tokens[-1] in EOS else "length")
            assert out.num_output_tokens == len(tokens) and out.num_prompt_tokens == len(prompt)
        finals.extend(outs)
    if with_greedy:
        for i, prompt in enumerate(prompts[:2]):
            greedy = [t for o in outputs[f"greedy{i}"] for t in o.new_token_ids]
            assert greedy == hf_greedy(hf, prompt), f"greedy request {i} beside the beams"
    assert engine.kv.num_free_blocks == free_at_start, "every block is free after"
    return finals


def hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("eos", [True, False], ids=["eos", "no-eos"])
def test_beams_match_transformers(setup, width: int, eos: bool) -> None:
    folder, hf, prompts = setup
    engine = make_engine(folder)
    for length_penalty in (0.0, 1.0, 2.0):
        for early_stopping in (True, False, "never"):
            check_against_hf(engine, hf, prompts, width, length_penalty, early_stopping, eos)


@pytest.mark.parametrize("engine_setup", ["async-chunked", "tiny-cache", "batch-of-one"])
def test_beams_match_transformers_under_scheduling(setup, engine_setup: str) -> None:
    folder, hf, prompts = setup
    engine = make_engine(folder, **ENGINE_SETUPS[engine_setup])
    check_against_hf(engine, hf, prompts, 4, 1.0, False, True,
                     with_greedy=engine_setup != "tiny-cache")
    if engine_setup == "tiny-cache":
        assert engine.cache_counters()[0] > 0, "the tiny cache should preempt some beam"


def test_eos_is_reachable(setup) -> None:
    """The EOS cases test something: beams end on EOS, others run to max_tokens."""
    folder, hf, prompts = setup
    finals = check_against_hf(make_engine(folder), hf, prompts, 4, 1.0, False, True,
                              with_greedy=False)
    reasons = {o.finish_reason for o in finals}
    assert reasons == {"stop", "length"}
    assert all(o.stop_reason in EOS for o in finals if o.finish_reason == "stop")


def test_beams_share_blocks(setup) -> None:
    """Four beams over a 60-token prompt hold about one copy of the prompt's blocks, not four."""
    folder = setup[0]
    prompt = [random.Random(5).randrange(3, 500) for _ in range(60)]
    engine = make_engine(folder)
    prompt_blocks = -(-len(prompt) // BLOCK_SIZE)
    outputs, peak = run(engine, {"beam": (prompt, beam_params(4, 1.0, False, False))})
    assert len(outputs["beam"]) == 4
    # Separate copies would hold 4 x (8 prompt + 2 output) blocks; shared, the prompt's
    # blocks once and each beam's own tail blocks.
    assert prompt_blocks < peak <= prompt_blocks + 4 * 3, peak
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_logprobs_and_stop_token_left_out(setup) -> None:
    """Without include_stop_str_in_output the EOS token is left out (vLLM's output), and
    logprobs where asked are each token's, with as many alternatives as asked."""
    folder, hf, prompts = setup
    engine = make_engine(folder)
    params = SamplingParams(n=4, max_tokens=MAX_NEW, use_beam_search=True, logprobs=2)
    outputs, _ = run(engine, {"r": (prompts[0], params)})
    want, _ = hf_beams(hf, prompts[0], 4, 1.0, False, True)
    outs = sorted(outputs["r"], key=lambda o: o.index)
    assert [o.new_token_ids for o in outs] == [t[:-1] if t[-1] in EOS else t for t in want]
    for out in outs:
        assert out.new_logprobs is not None
        assert [e.token_id for e in out.new_logprobs] == out.new_token_ids
        assert all(len(e.top) == 2 and e.rank >= 1 for e in out.new_logprobs)
        # Length penalty 1: the score is the mean logprob over the tokens, EOS counted.
        total = sum(e.logprob for e in out.new_logprobs)
        length = len(out.new_token_ids)
        assert out.beam_score is not None
        if out.finish_reason == "length":
            assert total / length == pytest.approx(out.beam_score, abs=1e-5)
        else:  # (the left-out EOS's logprob is below 0)
            assert total > out.beam_score * (length + 1)


def test_abort_frees_every_beam(setup) -> None:
    folder, _, prompts = setup
    engine = make_engine(folder)
    engine.add_request("r", prompts[2], beam_params(4, 1.0, False, False))
    for _ in range(4):
        engine.step()
    assert len(engine.sequences("r")) == 4, "four live beams after a few steps"
    engine.abort_request("r", [1])  # a beam request stops as a whole
    outs = engine.step()
    assert {o.finish_reason for o in outs} == {"abort"} and len(outs) == 4
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_refusals(setup) -> None:
    folder, _, prompts = setup
    engine = make_engine(folder)
    with pytest.raises(InvalidRequestError, match="resumed"):
        engine.add_request("r", prompts[0], beam_params(2, 1.0, False, False),
                           resumed={0: [5]})
    speculating = make_engine(folder, speculative_config=(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'))
    with pytest.raises(InvalidRequestError, match="speculative decoding"):
        speculating.add_request("r", prompts[0], beam_params(2, 1.0, False, False))
    assert not speculating.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="early_stopping"):
        SamplingParams(use_beam_search=True, early_stopping="sometimes")


def test_run_batch_answers_beam_search(setup, tmp_path: Path) -> None:
    """Offline: a run-batch line with use_beam_search answers transformers' beams as text."""
    folder, hf, _ = setup
    llm = OfflineLLM(make_engine(folder), load_tokenizer(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("once upon a time", add_special_tokens=False)["input_ids"]
    body = {"model": "tiny", "prompt": prompt, "n": 4, "max_tokens": MAX_NEW,
            "use_beam_search": True}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    (tmp_path / "in.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm, "tiny",
                        show_progress=False)
    assert summary.succeeded == 1
    answer = orjson.loads((tmp_path / "out.jsonl").read_bytes())["response"]["body"]
    want, _ = hf_beams(hf, prompt, 4, 1.0, False, True)
    want = [t[:-1] if t[-1] in EOS else t for t in want]  # (the stop token is left out)
    assert [c["text"] for c in answer["choices"]] == [
        tokenizer.decode(t, skip_special_tokens=True) for t in want]
    assert answer["usage"]["completion_tokens"] == sum(len(t) for t in want)


def test_beams_match_transformers_with_a_sliding_window(tmp_path: Path) -> None:
    """A Mistral whose window (12) is shorter than the beams: the beams keep their blocks
    behind the window (a fork's queries reach further back than its parent's); a second
    request over the same prompt takes its blocks from the prefix cache."""
    folder = build_tiny_model(tmp_path, "mistral", seed=2, sliding_window=12)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = make_engine(folder)
    assert engine.kv.window == 12
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 33)]
    for _ in range(2):  # (the second time, the prompts' blocks are prefix-cache hits)
        for prompt in prompts:
            params = SamplingParams(n=3, max_tokens=20, use_beam_search=True, ignore_eos=True)
            outputs, _ = run(engine, {"r": (prompt, params)})
            want, scores = hf_beams(hf, prompt, 3, 1.0, False, False, max_new=20)
            outs = sorted(outputs["r"], key=lambda o: o.index)
            assert [o.new_token_ids for o in outs] == want
            assert [o.beam_score for o in outs] == pytest.approx(scores, abs=1e-4)
    assert engine.cache_counters()[2] > 0, "the second pass should hit the prefix cache"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # The window lets a plain sequence outgrow the cache; a beam keeps every block.
    small = make_engine(folder, num_kv_blocks=5, max_model_len=64, max_num_batched_tokens=16)
    with pytest.raises(InvalidRequestError, match="beam search needs 45 tokens"):
        small.add_request("r", prompts[1], SamplingParams(n=2, max_tokens=12,
                                                          use_beam_search=True))
    small.add_request("plain", prompts[1], SamplingParams(max_tokens=12))
