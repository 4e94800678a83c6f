"""Speculative decoding in the engine: greedy output token for token that of transformers
and of the engine without drafts (n-gram, another draft model, the target's own weights as
draft), sampling that keeps the target distribution (chi-square), and consistent counts."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from engine_features import speculation_of
from test_engine_vs_hf import hf_greedy, make_engine, run_all, tokens_of
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.block_hash import hash_blocks
from meshserve.shared.kv_events import BlockStored
from meshserve.shared.sampling_params import SamplingParams

MAX_NEW = 32
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=1)
    other = build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=2,
                             num_hidden_layers=1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(5)
    loop = [rng.randrange(3, 400) for _ in range(7)]
    prompts = [loop * 6,  # repetition: n-gram drafts are found at once
               [rng.randrange(3, 400) for _ in range(21)],  # none in the prompt
               loop * 2 + [rng.randrange(3, 400) for _ in range(19)]]  # 33 tokens
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return folder, other, hf, prompts, expected


def draft_config(folder: Path, k: int = 3) -> str:
    return json.dumps({"model": str(folder), "num_speculative_tokens": k})


def spec_of(setup_, method: str) -> str:
    folder, other = setup_[0], setup_[1]
    return {"ngram": NGRAM, "draft-other": draft_config(other),
            "draft-same": draft_config(folder)}[method]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 24},  # prompts in chunks beside verify queries
    "tiny-cache-preempts": {"num_kv_blocks": 9, "max_num_batched_tokens": 64},
    # The overlapped loop (a GPU's default): steps without drafts queue behind the last.
    "overlapped": {"async_scheduling": "on"},
    "overlapped-chunked": {"async_scheduling": "on", "max_num_batched_tokens": 24},
    "overlapped-preempts": {"async_scheduling": "on", "num_kv_blocks": 9,
                            "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize(("method", "engine_setup"), [
    ("ngram", "default"), ("ngram", "chunked"), ("ngram", "tiny-cache-preempts"),
    ("ngram", "overlapped"), ("ngram", "overlapped-chunked"), ("ngram", "overlapped-preempts"),
    ("draft-other", "default"), ("draft-same", "chunked"),
    ("draft-same", "tiny-cache-preempts"), ("draft-other", "overlapped")])
def test_greedy_is_identical_with_and_without_drafts(setup, method: str,
                                                     engine_setup: str) -> None:
    folder, _, _, prompts, expected = setup
    engine = make_engine(folder, speculative_config=spec_of(setup, method),
                         **ENGINES[engine_setup])
    free_at_start = engine.kv.num_free_blocks
    outputs = run_all(engine, prompts, GREEDY)
    for i, want in enumerate(expected):
        assert tokens_of(outputs[f"r{i}"]) == want, f"prompt {i}, {method}, {engine_setup}"
        assert outputs[f"r{i}"][-1].finish_reason == "length"
        assert outputs[f"r{i}"][-1].num_output_tokens == MAX_NEW
    assert engine.kv.num_free_blocks == free_at_start, "rejected drafts' blocks leaked"
    assert speculation_of(engine) is not None
    drafts, drafted, accepted, _per_pos = speculation_of(engine).stats.snapshot()
    assert drafts > 0 and accepted <= drafted
    if method == "draft-same" and engine_setup != "tiny-cache-preempts":
        assert accepted == drafted, "the target's own greedy drafts are always accepted"
    if method != "draft-other":  # (an unrelated random draft may never be right)
        steps = sum(len(outputs[f"r{i}"]) for i in range(len(prompts)))
        assert accepted > 0 and steps < len(prompts) * MAX_NEW, "drafts must save steps"
    if method.startswith("draft"):  # a CPU engine has no graphs: every draft step is eager
        paths = speculation_of(engine).proposer.paths  # type: ignore[attr-defined]
        assert set(paths) == {"eager"} and paths["eager"] > 0


def test_overlapped_loop_keeps_steps_without_drafts_in_flight(setup) -> None:
    """With the overlapped loop on, a step is left in flight (the next one queued behind
    it) when none of its sequences could draft once read; a sequence whose tokens repeat
    still verifies drafts, in steps that are read before the next is scheduled."""
    folder, _, hf, prompts, _ = setup
    rng = random.Random(11)
    fresh = rng.sample(range(3, 400), 12)  # no repeated token in it
    for prompt, max_new in ((fresh, 6), (prompts[0], MAX_NEW)):
        engine = make_engine(folder, speculative_config=NGRAM, async_scheduling="on")
        assert engine.async_scheduling and speculation_of(engine) is not None
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_new,
                                                       ignore_eos=True))
        tokens: list[int] = []
        overlapped = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
            overlapped += engine._in_flight is not None
        assert tokens == hf_greedy(hf, prompt, max_new)
        drafts, _, accepted, _ = speculation_of(engine).stats.snapshot()
        if prompt is fresh:
            # Until a token repeats, no n-gram matches: the loop overlaps as without drafts.
            first_repeat = next((i for i in range(len(tokens))
                                 if (prompt + tokens)[len(prompt) + i] in prompt + tokens[:i]),
                                len(tokens))
            assert overlapped >= min(first_repeat, max_new - 1) - 1 > 0, (overlapped, tokens)
        else:
            assert drafts > 0 and accepted > 0  # the loop in the prompt is drafted from


def test_a_sequence_that_drafted_lately_is_waited_for(setup) -> None:
    """After a rejected draft the sequence ends in a token the text did not hold (no
    n-gram match), yet the next token usually matches again: for RECENT_DRAFT_STEPS steps
    the engine reads its step before scheduling, as it does when the known tokens match."""
    from meshserve.services.worker.engine.sequence import NEVER_DRAFTED, SequenceStatus
    from meshserve.services.worker.spec.decoder import RECENT_DRAFT_STEPS

    folder, _, _, _, _ = setup
    engine = make_engine(folder, speculative_config=NGRAM, async_scheduling="on")
    assert speculation_of(engine) is not None
    rng = random.Random(12)
    engine.add_request("r", rng.sample(range(3, 400), 10), GREEDY)  # no repeated token
    seq = engine.sequences("r")[0]
    seq.status = SequenceStatus.RUNNING
    assert seq.steps_since_drafts == NEVER_DRAFTED
    assert not speculation_of(engine).waits_for([seq])
    for since in range(RECENT_DRAFT_STEPS + 2):
        seq.steps_since_drafts = since
        assert speculation_of(engine).waits_for([seq]) == (since <= RECENT_DRAFT_STEPS), since
    seq.steps_since_drafts = NEVER_DRAFTED
    seq.prompt_token_ids.append(seq.prompt_token_ids[3])  # now the last token repeats
    assert speculation_of(engine).waits_for([seq])
    seq.grammar = object()  # a constrained sequence never drafts: never waited for
    assert not speculation_of(engine).waits_for([seq])


def test_counters_are_consistent(setup) -> None:
    folder, _, _, prompts, _ = setup
    engine = make_engine(folder, speculative_config=NGRAM)
    run_all(engine, prompts, GREEDY)
    assert speculation_of(engine) is not None
    drafts, drafted, accepted, per_pos = speculation_of(engine).stats.snapshot()
    assert drafted <= 4 * drafts and accepted <= drafted
    assert sum(per_pos) == accepted
    assert len(per_pos) <= 4 and per_pos[0] <= drafts
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), "a later position needs the earlier"


def test_logprobs_come_from_the_verify_pass(setup) -> None:
    folder, _, hf, prompts, _ = setup
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    with_spec = run_all(make_engine(folder, speculative_config=NGRAM), prompts[:1], params)
    outs = with_spec["r0"]
    generated = tokens_of(outs)
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(lps) == len(generated) == MAX_NEW
    assert any(len(o.new_token_ids) > 1 for o in outs), "some step must accept drafts"
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompts[0] + generated])).logits[0], dim=-1)
    for k, lp in enumerate(lps):
        row = ref[len(prompts[0]) - 1 + k]
        assert lp.token_id == generated[k] and lp.rank == 1
        assert abs(lp.logprob - row[generated[k]].item()) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()


def test_stop_token_inside_an_accepted_run_truncates(setup) -> None:
    folder, _, _, prompts, expected = setup
    # The loop's tokens come back in drafts; stop at the 26th output token's first use.
    want = expected[0]
    stop = want[25]
    cut = want.index(stop) + 1
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop])
    outputs = run_all(make_engine(folder, speculative_config=NGRAM), prompts[:1], params)
    assert tokens_of(outputs["r0"]) == want[:cut]
    assert outputs["r0"][-1].finish_reason == "stop"
    assert outputs["r0"][-1].stop_reason == stop


def test_n_sequences_and_max_tokens(setup) -> None:
    folder, _, _, prompts, expected = setup
    params = SamplingParams(n=2, temperature=0.0, max_tokens=13, ignore_eos=True)
    engine = make_engine(folder, speculative_config=NGRAM)
    engine.add_request("fan", prompts[0], params)
    seqs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seqs.setdefault(out.index, []).extend(out.new_token_ids)
    assert seqs == {0: expected[0][:13], 1: expected[0][:13]}


def test_prefix_cache_holds_only_accepted_tokens(setup) -> None:
    folder, _, _, prompts, expected = setup
    engine = make_engine(folder, speculative_config=NGRAM)
    run_all(engine, prompts[:1], GREEDY)
    # KV events announce exactly the full blocks of the real tokens (the last token has no
    # KV: it was never an input), never a block written with rejected drafts.
    stored = [h for e in engine.take_kv_events() if isinstance(e, BlockStored)
              for h in e.block_hashes]
    real = prompts[0] + expected[0]
    assert stored == hash_blocks(real[:len(real) - 1], 16)
    # The whole first sequence as a prompt: every full block it wrote must be a hit, and
    # the KV behind them must be that of its real tokens (the continuation matches).
    full = prompts[0] + expected[0]
    hf_more = tokens_of(run_all(make_engine(folder), [full], GREEDY)["r0"])
    outs = run_all(engine, [full], GREEDY)["r0"]
    assert outs[-1].num_cached_tokens == (len(full) - 1) // 16 * 16
    assert tokens_of(outs) == hf_more


def joint_first_two(hf: torch.nn.Module, prompt: list[int], top_k: int) -> dict:
    """P(t1, t2) under temperature 1 and top_k, from transformers' logits."""
    def filtered(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        keep = torch.topk(logits, top_k).indices
        probs = torch.zeros_like(logits)
        probs[keep] = torch.softmax(logits[keep], dim=0)
        return probs

    first = filtered(prompt)
    joint = {}
    for t1 in first.nonzero().flatten().tolist():
        second = filtered(prompt + [t1])
        for t2 in second.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


class LikeliestSecond:
    """Drafts, after the first output token t1, the likeliest t2 given t1 (as a greedy
    draft model of the target's weights would): accepted with probability p(t2 | t1)."""

    def __init__(self, joint: dict[tuple[int, int], float]) -> None:
        self.best: dict[int, int] = {}
        for (t1, t2), p in sorted(joint.items(), key=lambda item: item[1]):
            self.best[t1] = t2

    def propose_batch(self, requests: list, ks: list[int]) -> list[list[int]]:
        return [[self.best[r.output_token_ids[0]]][:k] for r, k in zip(requests, ks,
                                                                       strict=True)]


def test_sampling_keeps_the_target_distribution(setup) -> None:
    """Every t2 is drafted (the likeliest token), then accepted or corrected by rejection
    sampling; tests/unit/test_spec_rejection.py covers other drafts and full q."""
    folder, _, hf, prompts, _ = setup
    draws, top_k = 1000, 3
    prompt = prompts[0][:16]
    joint = joint_first_two(hf, prompt, top_k)
    engine = make_engine(folder, speculative_config=NGRAM, seed=3, max_num_seqs=500,
                         max_num_batched_tokens=16 * 500, num_kv_blocks=1100)
    assert speculation_of(engine) is not None
    speculation_of(engine).proposer = LikeliestSecond(joint)
    # max_tokens 3 leaves room for one draft after the first token: t2 is an accepted
    # draft or its correction.
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)
    outputs = run_all(engine, [prompt] * draws, params)
    counts: dict[tuple[int, int], int] = {}
    for outs in outputs.values():
        t1, t2 = tokens_of(outs)[:2]
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    assert set(counts) <= set(joint), "a token outside top_k was drawn"
    cells = sorted(joint)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    expected = torch.tensor([joint[c] for c in cells], dtype=torch.float64) * draws
    stat = ((observed - expected) ** 2 / expected).sum()
    p_value = float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0), stat / 2))
    assert p_value > 1e-3, f"chi-square {float(stat):.1f} over {len(cells)} cells"
    assert speculation_of(engine) is not None
    drafts, drafted, accepted, _ = speculation_of(engine).stats.snapshot()
    assert drafts > 0 and 0 < accepted < drafted, "both acceptance and correction must occur"


def test_constrained_requests_do_not_speculate(setup) -> None:
    folder, _, _, prompts, _ = setup
    engine: LLMEngine = make_engine(folder, speculative_config=NGRAM)
    engine.add_request("plain", prompts[0], GREEDY)
    engine.step()  # prefill
    seq = engine.sequences("plain")[0]
    assert speculation_of(engine) is not None and speculation_of(engine).num_drafts_for(seq) == 4
    seq.grammar = object()  # any matcher: the sequence is constrained
    assert speculation_of(engine).num_drafts_for(seq) == 0
    seq.grammar = None
    seq.max_tokens = seq.num_output_tokens + 2  # room for one draft and the bonus token
    assert speculation_of(engine).num_drafts_for(seq) == 1


def test_penalties_and_min_tokens_see_the_drafts_before_each_position(setup) -> None:
    folder, _, _, prompts, _ = setup
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.2,
                            frequency_penalty=0.3, min_tokens=MAX_NEW - 4)
    plain = run_all(make_engine(folder), prompts, params)
    engine = make_engine(folder, speculative_config=spec_of(setup, "draft-same"))
    spec = run_all(engine, prompts, params)
    for i in range(len(prompts)):
        assert tokens_of(spec[f"r{i}"]) == tokens_of(plain[f"r{i}"]), f"prompt {i}"
        assert spec[f"r{i}"][-1].finish_reason == plain[f"r{i}"][-1].finish_reason
    assert speculation_of(engine) is not None and speculation_of(engine).stats.snapshot()[2] > 0


def test_seeded_sampling_repeats_with_drafts(setup) -> None:
    folder, _, _, prompts, _ = setup
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    runs = [tokens_of(run_all(make_engine(folder, speculative_config=NGRAM, seed=s),
                              prompts[:1], params)["r0"]) for s in (1, 2)]
    assert runs[0] == runs[1], "a seeded request draws the same whatever the engine's seed"
