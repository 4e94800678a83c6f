"""Models whose every layer slides, against transformers, in a KV cache too small for their
sequences unless the blocks behind the window are freed.

Two tiny random folders written by transformers itself (tests/tiny_models.py): a Gemma 3 whose
`layer_types` are all "sliding_attention" (window 8) and a Mistral with `sliding_window` 12,
which slides every layer (its served context is no longer capped to the window). Prompts of
up to 90 tokens and 40 greedy tokens each: every sequence runs over several windows. The
engine has a 16-block cache of 8-token blocks (128 tokens): whole sequences (up to 130 tokens)
would not all fit even alone, so the outputs equal transformers' only if blocks are freed, and
only if nothing reads a freed block. Chunked prefill, the overlapped loop, prefix-cache hits
(taken only inside the window), preemption.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_engine_vs_hf import hf_greedy, make_engine
from test_models import load
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_cache_manager import PLACEHOLDER_BLOCK_ID
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.shared.model_config import max_model_len_of, read_folder
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 40
PROMPT_LENGTHS = [3, 21, 47, 90, 64]
BLOCK_SIZE = 8
NUM_BLOCKS = 16
BATCHED_TOKENS = 16
ARCHS = {
    "gemma3-all-sliding": ("gemma3", {"layer_types": ["sliding_attention"] * 4}, 8),
    "mistral": ("mistral", {"sliding_window": 12}, 12),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCHS))
def window_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides, window = ARCHS[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=2, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(5)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    # Shares 60 tokens with the 64-token prompt: prefix-cache hits when it comes later.
    prompts.append(prompts[4][:60] + [rng.randrange(3, vocab) for _ in range(7)])
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return folder, window, prompts, expected


def small_engine(folder: Path, **overrides: object) -> LLMEngine:
    options: dict[str, object] = {"block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS,
                                  "max_num_batched_tokens": BATCHED_TOKENS}
    options.update(overrides)
    return make_engine(folder, **options)


def run(engine: LLMEngine, prompts: list[list[int]], *, stagger: bool
        ) -> tuple[dict[str, list[SequenceOutput]], dict[str, int]]:
    """Run `prompts` to the end (with `stagger`, each added after the one before has run a
    step): each request's outputs and the most blocks it held at once."""
    outputs: dict[str, list[SequenceOutput]] = {}
    most_held: dict[str, int] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        batch, pending = (pending[:1], pending[1:]) if stagger else (pending, [])
        for i, prompt in batch:
            engine.add_request(f"r{i}", prompt, GREEDY)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        for seq in engine.scheduler.running:
            held = engine.kv.num_held_blocks(seq.request_id)
            most_held[seq.request_id] = max(most_held.get(seq.request_id, 0), held)
    return outputs, most_held


def check(engine: LLMEngine, window: int, prompts: list[list[int]],
          expected: list[list[int]], *, stagger: bool) -> dict[str, list[SequenceOutput]]:
    """Every output equals transformers'; every sequence held at most a step's window of
    blocks, the longest ones far fewer than their length needs; every block free at the end."""
    assert engine.kv.window == window
    outputs, most_held = run(engine, prompts, stagger=stagger)
    for i, want in enumerate(expected):
        got = [t for o in outputs[f"r{i}"] for t in o.new_token_ids]
        assert got == want, f"prompt {i} (len {len(prompts[i])})"
    peak = -(-(window - 1 + BATCHED_TOKENS) // BLOCK_SIZE) + 1
    assert max(most_held.values()) <= peak
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert len(prompts[longest]) + MAX_NEW > NUM_BLOCKS * BLOCK_SIZE  # it could not fit whole
    assert engine.kv.num_free_blocks == NUM_BLOCKS
    return outputs


def test_windows_are_read_and_context_is_not_capped(window_setup) -> None:
    folder, window, _, _ = window_setup
    config = load(folder).config
    assert config.layer_windows == (window,) * config.num_hidden_layers
    assert config.kv_window == window
    assert config.max_model_len == 256 == max_model_len_of(read_folder(folder))


SETUPS: dict[str, dict[str, object]] = {
    "chunked": {},
    "async": {"async_scheduling": "on"},
    "no-prefix-cache": {"enable_prefix_caching": False},
    # Prompts prefilled 8 tokens a step beside the others' decodes, on the overlapped loop.
    "async-capped-prefill": {"async_scheduling": "on", "long_prefill_token_threshold": 8},
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_in_a_cache_smaller_than_a_sequence_matches_transformers(window_setup,
                                                                       setup: str) -> None:
    folder, window, prompts, expected = window_setup
    check(small_engine(folder, **SETUPS[setup]), window, prompts, expected,
          stagger=setup in ("chunked", "async-capped-prefill"))


def test_prefix_hits_take_only_the_blocks_inside_the_window(window_setup) -> None:
    """The 67-token prompt after the 64-token one it shares 60 tokens with: its hits are the
    7 leading full blocks (56 tokens), of which only those inside the window of position 56
    are taken."""
    folder, window, prompts, expected = window_setup
    engine = small_engine(folder, num_kv_blocks=64)  # the first request's blocks stay cached
    outputs, _ = run(engine, [prompts[4]], stagger=False)
    engine.add_request("again", prompts[5], GREEDY)
    outs: list[SequenceOutput] = []
    table: list[int] = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        if engine.scheduler.running and not table:  # as admitted, before it advances
            table = list(engine.kv.block_ids("again"))
    assert [t for o in outs for t in o.new_token_ids] == expected[5]
    cached = 60 // BLOCK_SIZE * BLOCK_SIZE
    assert outs[-1].num_cached_tokens == cached
    behind = (cached - window + 1) // BLOCK_SIZE
    assert behind >= 5
    assert table[:behind] == [PLACEHOLDER_BLOCK_ID] * behind
    assert PLACEHOLDER_BLOCK_ID not in table[behind:]
    assert [t for o in outputs["r0"] for t in o.new_token_ids] == expected[4]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_in_a_window_sized_cache(window_setup, async_scheduling: str) -> None:
    """A cache of just over one step's peak: sequences are preempted and recomputed, and
    still give transformers' tokens."""
    folder, window, prompts, expected = window_setup
    num_blocks = -(-(window - 1 + BATCHED_TOKENS) // BLOCK_SIZE) + 3
    engine = small_engine(folder, num_kv_blocks=num_blocks, async_scheduling=async_scheduling)
    preempted = engine.cache_counters()[0]
    outputs, _ = run(engine, prompts, stagger=False)
    assert engine.cache_counters()[0] > preempted, "the cache must force preemption"
    for i, want in enumerate(expected):
        assert [t for o in outputs[f"r{i}"] for t in o.new_token_ids] == want, i
    assert engine.kv.num_free_blocks == num_blocks
