"""Speculative decoding on one engine: what a verify step costs and what single-stream TPOT
becomes, with the acceptance rate behind every figure.

Driver part: `spec`.

One in-process engine (built with an n-gram --speculative-config, so it captures verify CUDA
graphs and its runner verifies drafts) runs every mode in turn; only the proposer changes.
By default its weights are first rewritten into a copy model (loadtest/copy_model.py): greedy
decoding follows a fixed token chain with a wide logit gap, so acceptance is decided by the
drafts, not by bf16 rounding of flat dummy logits (--no-copy-model keeps the raw weights).

  verify_cost   step time of B sequences each verifying k drafts (k + 1 query tokens; random
                drafts, nearly all rejected: the cost does not depend on acceptance) against
                B plain 1-token decode steps, for each batch size B. Every shape is run once
                untimed first (kernels compiled, graphs warm), then in --rounds timed rounds
                (the lowest round median counts); the table says which forward path
                (whole-step graph, verify graph, piecewise, eager) the timed steps took.
  baseline      single-stream TPOT without speculation (the overlapped loop, the default; and
                the synchronous loop)
  ngram_quote   n-gram drafts, prompt quoting the whole answer (as an edited file quotes the
                original): acceptance near 100%
  ngram_partial n-gram drafts, the quote corrupted every --corrupt-every tokens: partial
                acceptance
  ngram_fresh   n-gram drafts configured, a prompt that quotes nothing (no match, no draft):
                against baseline_fresh (the same prompt without speculation) with the
                overlapped loop, and ngram_fresh_sync with it off (how speculating engines
                ran before steps without drafts were overlapped)
  (the speculating modes run with the overlapped loop on, as a GPU engine does by default)
  oracle        drafts are the known answer (100% acceptance, no lookup): the upper bound
  draft_same    a draft model that is the target's own weights (own KV cache, and CUDA graphs
                when the target has them): every draft accepted, each costing one target
                forward
  real          (--real-model) a real model (e.g. SmolLM2-135M-Instruct GGUF) on real text:
                a code-editing request and a summary quoting the prompt, n-gram drafts

Every mode's greedy tokens are compared with the baseline's (and with the copy model's chain).
TPOT = (time of the last token - time of the first) / (tokens - 1).

    python loadtest/spec_bench.py --model loadtest/models/llama-3.1-8b --load-format dummy \
        --out spec.json --markdown spec.md
    python loadtest/spec_bench.py --real-only --real-model default --device cpu  # real text
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from copy_model import make_copy_model, quoting_prompt
from spec_real import real_model_run

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.spec.decoder import SpecDecoder
from meshserve.services.worker.spec.setup import DraftShape, build_draft_proposer
from meshserve.shared.errors import MeshError
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.speculative_config import SpeculativeConfig


class FixedProposer:
    """k random drafts for every sequence (almost surely rejected)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose_batch(self, requests: list[SequenceState], ks: list[int]) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in ks]

    def may_draft(self, request: SequenceState) -> bool:
        del request
        return True


class OracleProposer:
    """The next k tokens of a known greedy output (per request id)."""

    def __init__(self, prompt_len: int, output: list[int]) -> None:
        self.prompt_len = prompt_len
        self.output = output

    def propose_batch(self, requests: list[SequenceState], ks: list[int]) -> list[list[int]]:
        out = []
        for request, k in zip(requests, ks, strict=True):
            done = request.num_tokens - self.prompt_len
            out.append(self.output[done : done + k])
        return out

    def may_draft(self, request: SequenceState) -> bool:
        del request
        return True


def single_stream(engine: LLMEngine, prompt: list[int], max_tokens: int,
                  ignore_eos: bool = True) -> dict[str, Any]:
    """One greedy request to completion: its tokens, TPOT, step count and forward paths."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    engine.add_request("s", prompt, params)
    tokens: list[int] = []
    times: list[float] = []
    paths: Counter[str] = Counter()
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        paths[engine.runner.last_path] += 1
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                tokens.extend(out.new_token_ids)
                times.append(now)
    # Tokens arriving together share a time: TPOT is over the whole decode.
    tpot = (times[-1] - times[0]) / max(len(tokens) - 1, 1)
    return {"tokens": tokens, "tpot_ms": tpot * 1e3, "steps": steps,
            "tokens_per_step": len(tokens) / max(steps, 1), "paths": dict(paths)}


def step_times(engine: LLMEngine, batch: int, warmup: int, iters: int
               ) -> tuple[float, dict[str, int]]:
    """Median ms of an engine step while `batch` sequences decode (all prefilled first), and
    the forward paths of the timed steps."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=warmup + iters + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}", [rng.randrange(3, vocab) for _ in range(64)], params)
    for _ in range(warmup):
        engine.step()
    times = []
    paths: Counter[str] = Counter()
    for _ in range(iters):
        _sync(engine)
        began = time.perf_counter()
        engine.step()
        _sync(engine)
        times.append(time.perf_counter() - began)
        paths[engine.runner.last_path] += 1
    for i in range(batch):
        engine.abort_request(f"b{i}")
    while engine.has_unfinished_requests():
        engine.step()
    times.sort()
    return times[len(times) // 2] * 1e3, dict(paths)


def use_spec(engine: LLMEngine, spec: SpecDecoder | None) -> None:
    """Swap the engine's speculation hook for `spec` (None: no speculation), between
    requests. The engine has no setter for this: a benchmark-only swap of the hook tuple
    (the engine was built with n-gram speculation, so its runner verifies and has verify
    graphs; only the proposer changes). The hook keeps its place in the tuple."""
    hooks = list(engine.hooks)
    at = next((i for i, hook in enumerate(hooks) if isinstance(hook, SpecDecoder)), None)
    if at is not None:
        del hooks[at]
    if spec is not None:
        hooks.insert(len(hooks) if at is None else at, spec)
    engine.hooks = tuple(hooks)


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def verify_cost(engine: LLMEngine, fixed: SpecDecoder, args: argparse.Namespace,
                results: dict[str, Any]) -> list[dict[str, Any]]:
    """Decode vs verify step time per batch size: one untimed round first (warm-up), then
    `--rounds` timed rounds, interleaved so that a passing disturbance (a neighbour's start-up
    on a shared host) hits one round; each figure is the lowest of its round medians."""
    rounds: dict[int, list[tuple[float, float]]] = {b: [] for b in args.batch_sizes}
    paths: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
    for round_ in range(args.rounds + 1):
        for batch in args.batch_sizes:
            use_spec(engine, None)
            engine.async_scheduling = False
            iters = args.iters if round_ else 3
            plain, plain_paths = step_times(engine, batch, args.warmup, iters)
            use_spec(engine, fixed)
            verify, verify_paths = step_times(engine, batch, args.warmup, iters)
            if round_:
                rounds[batch].append((plain, verify))
                paths[batch] = (plain_paths, verify_paths)
    cost = []
    for batch in args.batch_sizes:
        plain = min(r[0] for r in rounds[batch])
        verify = min(r[1] for r in rounds[batch])
        cost.append({"batch": batch, "decode_step_ms": plain, "verify_step_ms": verify,
                     "ratio": verify / plain, "round_medians_ms": rounds[batch],
                     "decode_paths": paths[batch][0], "verify_paths": paths[batch][1]})
        print(f"verify cost B={batch}: decode {plain:.2f} ms {paths[batch][0]}, verify "
              f"k={args.k} {verify:.2f} ms {paths[batch][1]} (rounds {rounds[batch]})",
              flush=True)
    results["verify_cost"] = cost
    _save(args, results)  # what is measured survives a later failure or timeout
    return cost


def acceptance(spec: SpecDecoder | None, before: tuple[int, int, int, list[int]]
               ) -> dict[str, Any]:
    if spec is None:
        return {}
    drafts, drafted, accepted, _per_pos = spec.stats.snapshot()
    d, t, a = drafts - before[0], drafted - before[1], accepted - before[2]
    return {"drafts": d, "draft_tokens": t, "accepted_tokens": a,
            "acceptance_rate": a / t if t else None,
            "mean_accepted_length": 1 + a / d if d else None}


def run_mode(engine: LLMEngine, spec: SpecDecoder | None, asynchronous: bool,
             prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    use_spec(engine, spec)
    engine.async_scheduling = asynchronous
    single_stream(engine, prompt, 16)  # warm-up of this mode's shapes
    before = spec.stats.snapshot() if spec is not None else (0, 0, 0, [])
    result = single_stream(engine, prompt, max_tokens, ignore_eos)
    result.update(acceptance(spec, before))
    return result


def single_stream_modes(engine: LLMEngine, ngram: SpecDecoder, successor: list[int],
                        args: argparse.Namespace, results: dict[str, Any]
                        ) -> dict[str, Any]:
    k, n = args.k, args.max_tokens
    quote_len = n + k + 16
    full, answer = quoting_prompt(successor, quote_len, seed=args.seed)
    partial, _ = quoting_prompt(successor, quote_len, args.corrupt_every, seed=args.seed)
    results["prompt_len"] = len(full)
    modes: dict[str, Any] = {}
    modes["baseline_async"] = run_mode(engine, None, True, full, n)
    modes["baseline_sync"] = run_mode(engine, None, False, full, n)
    reference = modes["baseline_async"]["tokens"]
    # The n-gram modes run as a GPU engine does by default: the overlapped loop on, steps
    # that may draft read before the next is scheduled.
    modes["ngram_quote"] = run_mode(engine, ngram, True, full, n)
    modes["ngram_partial"] = run_mode(engine, ngram, True, partial, n)
    # A prompt that quotes nothing (the filler and the chain's first token): no n-gram
    # matches, so speculation should cost nothing against the overlapped loop without it;
    # `_sync` is the loop speculating engines ran before (every step read at once).
    fresh = full[quote_len:]
    modes["baseline_fresh"] = run_mode(engine, None, True, fresh, n)
    modes["ngram_fresh"] = run_mode(engine, ngram, True, fresh, n)
    modes["ngram_fresh_sync"] = run_mode(engine, ngram, False, fresh, n)
    config = SpeculativeConfig("ngram", k)
    oracle = SpecDecoder(config, OracleProposer(len(full), reference), engine.max_model_len)
    modes["oracle"] = run_mode(engine, oracle, True, full, n)
    results["single_stream_partial"] = {m: _without_tokens(r) for m, r in modes.items()}
    _save(args, results)
    if not args.skip_draft:
        draft = build_draft_proposer(engine.model, engine.model_config, DraftShape(
            args.draft_blocks, engine.block_size, engine.dtype, engine.device,
            engine.max_num_seqs, engine.max_model_len, engine.max_num_batched_tokens,
            cuda_graphs=engine.graph_report is not None))
        same = SpecDecoder(SpeculativeConfig("draft_model", k, model=args.model), draft,
                           engine.max_model_len)
        modes["draft_same"] = run_mode(engine, same, True, full, n)
        modes["draft_same"]["draft_paths"] = dict(draft.paths)
    del results["single_stream_partial"]
    base = modes["baseline_async"]["tpot_ms"]
    for name, mode in modes.items():
        mode["identical_to_baseline"] = mode["tokens"] == reference
        mode["matching_prefix"] = _common_prefix(mode["tokens"], reference)
        mode["follows_chain"] = _common_prefix(mode["tokens"], answer)
        mode["speedup_vs_baseline_async"] = base / mode["tpot_ms"]
        print(f"{name}: TPOT {mode['tpot_ms']:.2f} ms, x{mode['speedup_vs_baseline_async']:.2f}"
              f", acceptance {mode.get('acceptance_rate')}, tokens/step "
              f"{mode['tokens_per_step']:.2f}, identical {mode['identical_to_baseline']}, "
              f"paths {mode['paths']}"
              + (f", draft paths {mode['draft_paths']}" if "draft_paths" in mode else ""),
              flush=True)
        del mode["tokens"]
    return modes


def bench(args: argparse.Namespace) -> dict[str, Any]:
    spec_json = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    engine = build_engine(EngineConfig(
        model=args.model, load_format=args.load_format, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, speculative_config=spec_json))
    ngram = engine.hook(SpecDecoder)
    assert ngram is not None
    vocab = engine.model_config.vocab_size
    if args.copy_model:
        successor = make_copy_model(engine.model, seed=args.seed)
    else:  # raw weights: the same prompts, whatever the model makes of them
        successor = list(range(vocab))
        random.Random(args.seed).shuffle(successor)
    results: dict[str, Any] = {"k": args.k, "model": args.model, "device": _device_name(engine),
                               "copy_model": args.copy_model, "max_tokens": args.max_tokens,
                               "corrupt_every": args.corrupt_every,
                               "graphs": engine.graph_report is not None}
    fixed = SpecDecoder(SpeculativeConfig("ngram", args.k), FixedProposer(vocab),
                        engine.max_model_len)
    cost = verify_cost(engine, fixed, args, results)
    modes = single_stream_modes(engine, ngram, successor, args, results)
    results["single_stream"] = modes
    results["expected_speedup_by_acceptance"] = _projection(
        cost[0], args.k, modes["baseline_async"]["tpot_ms"])
    del engine, ngram, fixed
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.real_model:
        try:
            results["real"] = real_model_run(args.real_model, args.device, args.k,
                                             args.real_tokens, run_mode)
        except (MeshError, OSError, RuntimeError, ValueError) as exc:  # the rest stands
            print(f"real model run failed: {exc!r}", flush=True)
            results["real_error"] = repr(exc)
    return results


def _save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def _without_tokens(mode: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in mode.items() if key != "tokens"}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _projection(cost: dict[str, float], k: int, base_tpot_ms: float) -> list[dict[str, float]]:
    """Speedup at acceptance rate a (independent per position) if drafts were free: a verify
    step yields (1 - a^(k+1)) / (1 - a) tokens for the measured batch-1 verify step time."""
    rows = []
    for rate in (0.0, 0.3, 0.5, 0.7, 0.9, 1.0):
        tokens = k + 1 if rate == 1.0 else (1 - rate ** (k + 1)) / (1 - rate)
        rows.append({"acceptance_rate": rate, "tokens_per_step": tokens,
                     "speedup": base_tpot_ms / (cost["verify_step_ms"] / tokens)})
    return rows


def _device_name(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return "cpu"


def _paths(paths: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(paths.items()))


def markdown(results: dict[str, Any]) -> str:
    k = results["k"]
    weights = ("copy model (peaked logits along a token chain)" if results["copy_model"]
               else "raw dummy weights (flat logits: acceptance is bf16 noise)")
    lines = [f"# Speculative decoding, k = {k} ({results['device']}, {weights})", "",
             "## Verify step cost (random drafts: the cost alone; median of steady-state steps)",
             "", ("| batch | 1-token decode step (ms) | verify step, k+1 tokens (ms) | ratio | "
                  "decode path | verify path |"), "|---|---|---|---|---|---|"]
    lines += [f"| {c['batch']} | {c['decode_step_ms']:.2f} | {c['verify_step_ms']:.2f} | "
              f"{c['ratio']:.2f} | {_paths(c['decode_paths'])} | {_paths(c['verify_paths'])} |"
              for c in results.get("verify_cost", [])]
    lines += ["", (f"## Single stream ({results['prompt_len']}-token prompt quoting the answer, "
              f"{results['max_tokens']} tokens, greedy; partial: quote corrupted every "
              f"{results['corrupt_every']} tokens)"), "",
              ("| mode | TPOT (ms) | speedup vs baseline | acceptance | tokens/step | "
              "tokens matching baseline | tokens on the chain | step paths |"),
              "|---|---|---|---|---|---|---|---|"]
    n = results["max_tokens"]
    for name, m in results["single_stream"].items():
        rate = m.get("acceptance_rate")
        lines.append(f"| {name} | {m['tpot_ms']:.2f} | {m['speedup_vs_baseline_async']:.2f} | "
                     f"{'-' if rate is None else f'{rate:.2f}'} | {m['tokens_per_step']:.2f} | "
                     f"{m['matching_prefix']}/{n} | {m['follows_chain']}/{n} | "
                     f"{_paths(m['paths'])}"
                     + (f"; draft: {_paths(m['draft_paths'])}" if "draft_paths" in m else "")
                     + " |")
    lines += ["", "## Projected speedup by acceptance rate (free drafts, batch-1 verify cost)",
              "", "| acceptance | tokens per verify step | speedup |", "|---|---|---|"]
    lines += [f"| {p['acceptance_rate']:.1f} | {p['tokens_per_step']:.2f} | {p['speedup']:.2f} |"
              for p in results["expected_speedup_by_acceptance"]]
    if results.get("real"):
        lines += ["", real_markdown(results["real"])]
    return "\n".join(lines) + "\n"


def real_markdown(real: dict[str, Any]) -> str:
    lines = [f"## Real model ({real['model']}, {real['device']}), n-gram k = {real['k']}", "",
             ("| prompt | prompt tokens | output tokens | baseline TPOT (ms) | n-gram TPOT (ms) | "
              "speedup | acceptance | tokens/step | identical text |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in real["prompts"].items():
        ng = r["ngram"]
        rate = ng.get("acceptance_rate")
        lines.append(f"| {name} | {r['prompt_len']} | {ng['output_tokens']} | "
                     f"{r['baseline']['tpot_ms']:.2f} | "
                     f"{ng['tpot_ms']:.2f} | {r['speedup']:.2f} | "
                     f"{'-' if rate is None else f'{rate:.2f}'} | {ng['tokens_per_step']:.2f} | "
                     f"{r['identical']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the target (not needed with --real-only)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.75,
                        help="the target's share; the draft's own cache needs the rest")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--draft-blocks", type=int, default=256,
                        help="blocks of the draft model's own KV cache (draft_same)")
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8, 32])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of verify_cost")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--corrupt-every", type=int, default=8,
                        help="ngram_partial: every n-th quoted token is replaced")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-copy-model", dest="copy_model", action="store_false",
                        help="keep the loaded weights (dummy: flat logits)")
    parser.add_argument("--skip-draft", action="store_true")
    parser.add_argument("--real-model", default=None,
                        help="also run n-gram on this real model (folder, .gguf or 'default')")
    parser.add_argument("--real-only", action="store_true", help="only the real-model run")
    parser.add_argument("--real-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.real_only and not args.real_model:
        parser.error("--real-only needs --real-model")
    if not args.real_only and not args.model:
        parser.error("--model is required (unless --real-only)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real_only:
        real = real_model_run(args.real_model, args.device, args.k, args.real_tokens, run_mode)
        table = real_markdown(real)
        results: dict[str, Any] = {"real": real}
    else:
        results = bench(args)
        results["all_identical"] = all(m["identical_to_baseline"]
                                       for m in results["single_stream"].values())
        table = markdown(results)
    _save(args, results)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
