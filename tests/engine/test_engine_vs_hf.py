"""The engine against Hugging Face transformers on the same weights, token for token.

Tiny random-weight Llama, Qwen2 and Qwen3 models are written by transformers
itself (tests/tiny_models.py); transformers' greedy `generate` and its
log-softmax are the reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 10
PROMPT_LENGTHS = [1, 3, 16, 17, 33, 64, 90]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return hf_setup(request.param, tmp_path_factory)


def hf_setup(arch: str, tmp_path_factory: pytest.TempPathFactory, **overrides: object,
             ) -> tuple[Path, torch.nn.Module, list[list[int]], list[list[int]]]:
    """A tiny `arch` model (`overrides` into its config), transformers' copy of it, the
    prompts and its greedy outputs."""
    folder = build_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=1, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    # Two prompts that share a 48-token prefix with the 64-token one: prefix-cache hits.
    prompts.append(prompts[5][:48] + [rng.randrange(3, vocab) for _ in range(9)])
    prompts.append(prompts[5][:32] + [rng.randrange(3, vocab) for _ in range(20)])
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return folder, hf, prompts, expected


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_engine(folder: Path, **overrides: object) -> LLMEngine:
    cfg = {"model": str(folder), "dtype": "float32", "device": "cpu", "block_size": 16,
               "num_kv_blocks": 256}
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
            stagger: bool = False) -> dict[str, list[SequenceOutput]]:
    """Run requests to completion; with `stagger`, add each after the previous one's first step."""
    outputs: dict[str, list[SequenceOutput]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            batch = [pending.pop(0)] if stagger else pending
            for i, prompt in batch:
                engine.add_request(f"r{i}", prompt, params)
            if not stagger:
                pending = []
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outs: list[SequenceOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

ENGINE_SETUPS = {
    "chunked": {"max_num_batched_tokens": 40},
    "not-chunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
    "no-prefix-cache": {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
    "tiny-cache-preempts": {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64},
    "batch-of-one": {"max_num_seqs": 1},
    # The overlapped loop (the GPU default), forced on for the CPU path.
    "async-chunked": {"max_num_batched_tokens": 40, "async_scheduling": "on"},
    # Prompts prefilled 8 tokens a step beside the decodes of the others.
    "capped-prefill": {"max_num_batched_tokens": 40, "long_prefill_token_threshold": 8},
    "async-capped-prefill": {"max_num_batched_tokens": 40, "long_prefill_token_threshold": 8,
                             "async_scheduling": "on"},
    "async-tiny-cache-preempts": {"num_kv_blocks": 12, "block_size": 16,
                                  "max_num_batched_tokens": 64, "async_scheduling": "on"},
}
STAGGERED = ("chunked", "async-chunked", "capped-prefill", "async-capped-prefill")


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_matches_transformers(arch_setup, setup: str) -> None:
    folder, _, prompts, expected = arch_setup
    engine = make_engine(folder, **ENGINE_SETUPS[setup])
    free_at_start = engine.kv.num_free_blocks
    outputs = run_all(engine, prompts, GREEDY, stagger=setup in STAGGERED)
    for i, want in enumerate(expected):
        got = tokens_of(outputs[f"r{i}"])
        assert got == want, f"prompt {i} (len {len(prompts[i])}) under {setup}"
        assert outputs[f"r{i}"][-1].finish_reason == "length"
    assert engine.kv.num_free_blocks == free_at_start
    if setup in ("chunked", "async-chunked"):  # (capped chunks finish the prefix later)
        cached = {i: outputs[f"r{i}"][-1].num_cached_tokens for i in (7, 8)}
        assert cached == {7: 48, 8: 32}, "later requests should reuse the shared prefix blocks"


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_happens_and_outputs_still_match(arch_setup, async_scheduling: str) -> None:
    folder, _, prompts, expected = arch_setup
    engine = make_engine(folder, num_kv_blocks=10, max_num_batched_tokens=64,
                         async_scheduling=async_scheduling)
    check_preemption(engine, prompts, expected)


def check_greedy(engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]], *,
                 stagger: bool = True, prefix_hits: bool = True) -> None:
    """Run `prompts` (arriving one step apart with `stagger`): every output must equal
    `expected`, the two prompts sharing the 64-token prompt's prefix must find 48 and 32
    tokens cached (with `prefix_hits`), and every block must be free at the end."""
    free_at_start = engine.kv.num_free_blocks
    outputs = run_all(engine, prompts, GREEDY, stagger=stagger)
    for i, want in enumerate(expected):
        assert tokens_of(outputs[f"r{i}"]) == want, f"prompt {i} (len {len(prompts[i])})"
    if prefix_hits:
        cached = {i: outputs[f"r{i}"][-1].num_cached_tokens for i in (7, 8)}
        assert cached == {7: 48, 8: 32}, "later requests should reuse the shared prefix blocks"
    assert engine.kv.num_free_blocks == free_at_start


def check_logprobs(engine: LLMEngine, prompts: list[list[int]],
                   reference: Callable[[list[int]], torch.Tensor]) -> None:
    """Greedy with 5 logprobs: each chosen token's logprob within 1e-4 of the reference's
    log-softmax (`reference(tokens)` -> logits [len, V]) and the top 5 in its order."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = run_all(engine, prompts, params)
    for j, prompt in enumerate(prompts):
        outs = outputs[f"r{j}"]
        generated = tokens_of(outs)
        with torch.no_grad():
            ref = torch.log_softmax(reference(prompt + generated), -1)
        lps = [lp for o in outs for lp in (o.new_logprobs or [])]
        assert len(lps) == len(generated) == MAX_NEW
        for k, lp in enumerate(lps):
            row = ref[len(prompt) - 1 + k]
            assert abs(lp.logprob - row[generated[k]].item()) < 1e-4
            assert [t for t, _ in lp.top] == torch.topk(row, 5).indices.tolist()


def hf_reference(hf: torch.nn.Module) -> Callable[[list[int]], torch.Tensor]:
    """transformers' logits of a whole token sequence, one forward."""
    return lambda tokens: hf(torch.tensor([tokens])).logits[0]


def check_preemption(engine: LLMEngine, prompts: list[list[int]],
                     expected: list[list[int]]) -> None:
    """Run `prompts` on an engine of 10 KV blocks: some sequence must be preempted, every
    output must still equal `expected`, and every block must be free at the end."""
    preempted: set[str] = set()
    original = engine.scheduler._preempt

    def spy(request, out):  # record which sequences lose their blocks
        preempted.add(request.request_id)
        original(request, out)

    engine.scheduler._preempt = spy  # type: ignore[method-assign]
    outputs = run_all(engine, prompts, GREEDY)
    assert preempted, "a 10-block cache must force preemption"
    for i, want in enumerate(expected):
        assert tokens_of(outputs[f"r{i}"]) == want, f"prompt {i} after preemption"
    assert engine.kv.num_free_blocks == 10


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_logprobs_match_transformers_log_softmax(arch_setup, async_scheduling: str) -> None:
    folder, hf, prompts, _expected = arch_setup
    engine = make_engine(folder, max_num_batched_tokens=48, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    outputs = run_all(engine, prompts[2:6], params)
    for j, prompt in enumerate(prompts[2:6]):
        outs = outputs[f"r{j}"]
        generated = tokens_of(outs)
        full = torch.tensor([prompt + generated])
        with torch.no_grad():
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)  # [L, V]
        lps = [lp for o in outs for lp in (o.new_logprobs or [])]
        assert len(lps) == len(generated)
        for k, lp in enumerate(lps):
            row = ref[len(prompt) - 1 + k]
            assert lp.token_id == generated[k]
            assert abs(lp.logprob - row[generated[k]].item()) < 1e-4
            top_ids = [t for t, _ in lp.top]
            assert top_ids == torch.topk(row, 5).indices.tolist()
            for t, value in lp.top:
                assert abs(value - row[t].item()) < 1e-4
            assert lp.rank == 1  # greedy picks the argmax
        prompt_lps = outs[0].prompt_logprobs
        assert prompt_lps is not None and len(prompt_lps) == len(prompt)
        assert prompt_lps[0] is None
        for pos in range(1, len(prompt)):
            entry = prompt_lps[pos]
            assert entry is not None and entry.token_id == prompt[pos]
            assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            assert len(entry.top) == 3
            rank = int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum().item()) + 1
            assert entry.rank == rank


def test_n_sequences_share_the_prompt_blocks(arch_setup) -> None:
    folder, _, prompts, _ = arch_setup
    engine = make_engine(folder)
    free_at_start = engine.kv.num_free_blocks
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("fan", prompts[6], params)  # 90 tokens: 5 full blocks
    finals: dict[int, SequenceOutput] = {}
    seqs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seqs.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.index] = out
    assert sorted(finals) == [0, 1, 2]
    assert finals[0].num_cached_tokens == 0
    assert finals[1].num_cached_tokens == finals[2].num_cached_tokens == 80
    assert all(len(s) == 6 for s in seqs.values())
    assert len({tuple(s) for s in seqs.values()}) > 1, "sibling seeds must differ"
    assert engine.kv.num_free_blocks == free_at_start
