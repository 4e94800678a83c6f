"""Speculative decoding on one engine: what a verify step costs and what single-stream TPOT
becomes, with the acceptance rate behind every figure.

One in-process engine (built with an n-gram --speculative-config, so its runner verifies
drafts) runs every mode in turn; only the proposer changes between them:

  verify_cost   step time of B sequences each verifying k drafts (k + 1 query tokens; the
                drafts are random, so nearly all are rejected: the cost does not depend on
                acceptance) against B plain 1-token decode steps, for each batch size B
  baseline      single-stream TPOT without speculation (the overlapped loop, the default; and
                the synchronous loop that speculating steps use)
  ngram         single-stream TPOT with n-gram drafts on a repetitive prompt (a token loop
                repeated), with the acceptance rate that the model's own output gave
  oracle        drafts are the baseline's own greedy continuation (what n-gram lookup proposes
                on a workload that repeats exactly): acceptance 100% at the cost of a host
                lookup, the upper bound of n-gram speculation
  draft_same    a draft model that is the target's own weights (own KV cache, eager): every
                draft accepted, each costing one target forward
  real_ngram    (--real-model) a real model on a code-editing prompt (the answer repeats most of
                the prompt), n-gram drafts with their real acceptance

Every speculative mode's greedy tokens are compared with the baseline's (identical, or how
many leading tokens match: in bf16 a k + 1 token query runs other kernels and GEMM shapes
than a 1-token decode, so a near-tie can flip, as with any change of batch shape). TPOT = (time of the last token - time of the first) / (tokens - 1).

    python loadtest/spec_bench.py --model loadtest/models/llama-3.1-8b --load-format dummy \
        --out spec.json --markdown spec.md
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from meshserve.services.worker.engine.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.request import Request
from meshserve.services.worker.spec.decoder import SpecDecoder
from meshserve.services.worker.spec.draft_model import DraftModelProposer
from meshserve.shared.errors import MeshError
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.speculative_config import SpeculativeConfig


class FixedProposer:
    """k random drafts for every sequence (almost surely rejected)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose_batch(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in ks]


class OracleProposer:
    """The next k tokens of a known greedy output (per request id)."""

    def __init__(self, prompt_len: int, output: list[int]) -> None:
        self.prompt_len = prompt_len
        self.output = output

    def propose_batch(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for request, k in zip(requests, ks, strict=True):
            done = request.num_tokens - self.prompt_len
            out.append(self.output[done : done + k])
        return out


def single_stream(engine: LLMEngine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy request to completion: its tokens, TPOT and the engine's step count."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("s", prompt, params)
    tokens: list[int] = []
    times: list[float] = []
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                tokens.extend(out.new_token_ids)
                times.append(now)
    # Tokens arriving together share a time: TPOT is over the whole decode.
    tpot = (times[-1] - times[0]) / max(len(tokens) - 1, 1)
    return {"tokens": tokens, "tpot_ms": tpot * 1e3, "steps": steps,
            "tokens_per_step": len(tokens) / max(steps, 1)}


def step_times(engine: LLMEngine, batch: int, warmup: int, iters: int) -> float:
    """Median ms of an engine step while `batch` sequences decode (all prefilled first)."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=warmup + iters + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}", [rng.randrange(3, vocab) for _ in range(64)], params)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(iters):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    for i in range(batch):
        engine.abort_request(f"b{i}")
    while engine.has_unfinished_requests():
        engine.step()
    times.sort()
    return times[len(times) // 2] * 1e3


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
             prompt: list[int], max_tokens: int) -> dict[str, Any]:
    engine.spec = spec
    engine.async_scheduling = asynchronous
    before = spec.stats.snapshot() if spec is not None else (0, 0, 0, [])
    single_stream(engine, prompt, 8)  # warm-up of this mode's shapes
    before = spec.stats.snapshot() if spec is not None else before
    result = single_stream(engine, prompt, max_tokens)
    result.update(acceptance(spec, before))
    return result


def repetitive_prompt(vocab: int, loop_len: int, repeats: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    loop = [rng.randrange(3, vocab) for _ in range(loop_len)]
    return loop * repeats


def bench(args: argparse.Namespace) -> dict[str, Any]:
    k = args.k
    spec_json = json.dumps({"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, speculative_config=spec_json))
    ngram = engine.spec
    assert ngram is not None
    config = SpeculativeConfig("ngram", k)
    results: dict[str, Any] = {"k": k, "model": args.model, "device": _device_name(engine),
                               "prompt_len": args.loop_len * args.repeats,
                               "max_tokens": args.max_tokens}
    # (a) verify cost
    fixed = SpecDecoder(config, FixedProposer(engine.model_config.vocab_size), engine.max_model_len)
    cost = []
    for batch in args.batch_sizes:
        engine.spec, engine.async_scheduling = None, False
        plain = step_times(engine, batch, args.warmup, args.iters)
        engine.spec = fixed
        verify = step_times(engine, batch, args.warmup, args.iters)
        cost.append({"batch": batch, "decode_step_ms": plain, "verify_step_ms": verify,
                     "ratio": verify / plain})
        print(f"verify cost B={batch}: decode {plain:.2f} ms, verify k={k} {verify:.2f} ms",
              flush=True)
        results["verify_cost"] = cost
        _save(args, results)  # what is measured survives a later failure or timeout
    # (b) single stream
    prompt = repetitive_prompt(engine.model_config.vocab_size, args.loop_len, args.repeats)
    modes: dict[str, Any] = {}
    modes["baseline_async"] = run_mode(engine, None, True, prompt, args.max_tokens)
    modes["baseline_sync"] = run_mode(engine, None, False, prompt, args.max_tokens)
    reference = modes["baseline_async"]["tokens"]
    modes["ngram"] = run_mode(engine, ngram, False, prompt, args.max_tokens)
    oracle = SpecDecoder(config, OracleProposer(len(prompt), reference), engine.max_model_len)
    modes["oracle"] = run_mode(engine, oracle, False, prompt, args.max_tokens)
    results["single_stream_partial"] = {n: _without_tokens(m) for n, m in modes.items()}
    _save(args, results)
    if not args.skip_draft:
        draft = DraftModelProposer(engine.runner.model, engine.model_config,
                                   args.draft_blocks, engine.kv.block_size, engine.dtype,
                                   engine.device)
        same = SpecDecoder(SpeculativeConfig("draft_model", k, model=args.model), draft,
                           engine.max_model_len)
        modes["draft_same"] = run_mode(engine, same, False, prompt, args.max_tokens)
    del results["single_stream_partial"]
    base = modes["baseline_async"]["tpot_ms"]
    for name, mode in modes.items():
        mode["identical_to_baseline"] = mode["tokens"] == reference
        mode["matching_prefix"] = _common_prefix(mode["tokens"], reference)
        mode["speedup_vs_baseline_async"] = base / mode["tpot_ms"]
        print(f"{name}: TPOT {mode['tpot_ms']:.2f} ms, x{mode['speedup_vs_baseline_async']:.2f}"
              f", acceptance {mode.get('acceptance_rate')}, identical "
              f"{mode['identical_to_baseline']}", flush=True)
        del mode["tokens"]
    results["single_stream"] = modes
    results["expected_speedup_by_acceptance"] = _projection(cost[0], k, base)
    del engine, ngram, fixed, oracle
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.real_model:
        try:
            results["real_ngram"] = real_model_run(args)
        except (MeshError, OSError, RuntimeError, ValueError) as exc:  # the rest stands
            print(f"real model run failed: {exc!r}", flush=True)
            results["real_ngram_error"] = repr(exc)
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


CODE_PROMPT = '''Rename the variable `total` to `subtotal` in this function and return the whole \
function.

def price(items, tax_rate):
    total = 0
    for item in items:
        if item.discount:
            total += item.cost * (1 - item.discount)
        else:
            total += item.cost
    tax = total * tax_rate
    return round(total + tax, 2)

Answer:
'''


def real_model_run(args: argparse.Namespace) -> dict[str, Any]:
    """n-gram speculation on a real model and a code-editing prompt (its own tokenizer)."""
    from transformers import AutoTokenizer

    from meshserve.shared.model_source import resolve_model, tokenizer_folder

    source = resolve_model(args.real_model)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(source))
    prompt = tokenizer.encode(CODE_PROMPT)
    out: dict[str, Any] = {"model": args.real_model, "prompt_len": len(prompt)}
    for name, spec in (("baseline", None), ("ngram", json.dumps(
            {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}))):
        engine = LLMEngine(EngineConfig(model=args.real_model, device=args.device,
                                        max_model_len=2048, max_num_seqs=8,
                                        num_kv_blocks=args.num_kv_blocks or 1024,
                                        speculative_config=spec))
        result = run_mode(engine, engine.spec, engine.spec is None, prompt, args.real_tokens)
        result["text"] = tokenizer.decode(result.pop("tokens"))
        out[name] = result
        print(f"real {name}: TPOT {result['tpot_ms']:.2f} ms, acceptance "
              f"{result.get('acceptance_rate')}", flush=True)
        del engine
        gc.collect()
    out["identical"] = out["baseline"]["text"] == out["ngram"]["text"]
    out["speedup"] = out["baseline"]["tpot_ms"] / out["ngram"]["tpot_ms"]
    return out


def _device_name(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return "cpu"


def markdown(results: dict[str, Any]) -> str:
    k = results["k"]
    lines = [f"# Speculative decoding, k = {k} ({results['device']})", "",
             "## Verify step cost (random drafts: the cost alone)", "",
             "| batch | 1-token decode step (ms) | verify step, k+1 tokens (ms) | ratio |",
             "|---|---|---|---|"]
    lines += [f"| {c['batch']} | {c['decode_step_ms']:.2f} | {c['verify_step_ms']:.2f} | "
              f"{c['ratio']:.2f} |" for c in results["verify_cost"]]
    lines += ["", (f"## Single stream ({results['prompt_len']}-token repetitive prompt, "
              f"{results['max_tokens']} tokens, greedy)"), "",
              ("| mode | TPOT (ms) | speedup vs baseline | acceptance | tokens/step | "
              "tokens matching baseline |"), "|---|---|---|---|---|---|"]
    for name, m in results["single_stream"].items():
        rate = m.get("acceptance_rate")
        lines.append(f"| {name} | {m['tpot_ms']:.2f} | {m['speedup_vs_baseline_async']:.2f} | "
                     f"{'-' if rate is None else f'{rate:.2f}'} | {m['tokens_per_step']:.2f} | "
                     f"{m['matching_prefix']}/{results['max_tokens']} |")
    lines += ["", "## Projected speedup by acceptance rate (free drafts, batch 1)", "",
              "| acceptance | tokens per verify step | speedup |", "|---|---|---|"]
    lines += [f"| {p['acceptance_rate']:.1f} | {p['tokens_per_step']:.2f} | {p['speedup']:.2f} |"
              for p in results["expected_speedup_by_acceptance"]]
    real = results.get("real_ngram")
    if real:
        lines += ["", f"## Real model ({real['model']}), code-editing prompt", "",
                  (f"baseline TPOT {real['baseline']['tpot_ms']:.2f} ms, n-gram TPOT "
                  f"{real['ngram']['tpot_ms']:.2f} ms (x{real['speedup']:.2f}), acceptance "
                  f"{real['ngram'].get('acceptance_rate')}, identical text {real['identical']}")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
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
    parser.add_argument("--loop-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--skip-draft", action="store_true")
    parser.add_argument("--real-model", default=None,
                        help="also run n-gram on this real model with a code-editing prompt")
    parser.add_argument("--real-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    results = bench(args)
    results["all_identical"] = all(m["identical_to_baseline"]
                                   for m in results["single_stream"].values())
    _save(args, results)
    table = markdown(results)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
