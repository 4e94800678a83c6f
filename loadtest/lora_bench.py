"""Multi-LoRA serving cost, in process: throughput of a ShareGPT-like load spread over many
adapters against the base model, and single-stream time per output token with and without
an adapter.

Driver part: `lora`.

    python loadtest/lora_bench.py adapters --model M --out /tmp/adapters --count 8 --rank 16
    python loadtest/lora_bench.py check    --model M --out check.json   # kernels vs reference
    python loadtest/lora_bench.py run --model M --load-format dummy --out base.json
    python loadtest/lora_bench.py run --model M --load-format dummy --out lora.json \\
        --adapters /tmp/adapters --count 8 --rank 16
    python loadtest/lora_bench.py run --model M --load-format dummy --out eager.json \\
        --adapters /tmp/adapters --count 8 --rank 16 --enforce-eager --consistency-only
    python loadtest/lora_bench.py summary --base base.json --lora lora.json --out-md t.md \\
        --eager eager.json

`adapters` writes random PEFT adapters (all seven projections of every layer) shaped for
the model's config.json. Their A and B are unit-gain random maps (A ~ N(0, 1/fan_in),
B ~ N(0, 1/r), alpha = 2r), so an adapter's product has about twice its input's scale. That
is what it takes to change a dummy model's tokens: its weights are uniform in +-1e-3, norm
weights included, so each layer adds only ~0.1% to the residual stream (the embedding) and
the next token nearly follows from the last one. Adapters that merely double each
projection's output (B ~ 0.01) are applied, yet move the first position's logits by ~2% of
their spread, below the top-2 gap, and change no greedy token.

`run` builds one engine (with --adapters: --enable-lora, one slot per adapter) and
measures: `tput_base` every request on the base model; with adapters also `tput_lora` the
same requests spread round-robin over the adapters; then single-stream decode (`tpot_base`,
and `tpot_lora` with the first adapter). Throughput is the mean of `--passes` passes over
the same requests (each pass's figure is kept too). With adapters, `consistency` first
checks that they are applied: greedy tokens alone vs in a mixed batch vs the base model, and
the max |logit difference| between each adapter and the base model at the first generated
position. `--enforce-eager --consistency-only` runs only that check, without CUDA graphs and
also with the grouped torch path in place of the Triton kernels, so that a graph problem
shows apart from a kernel problem; first-position logits are saved next to `--out`
(`.logits.pt`) and `summary --eager` compares the graph run's with the eager one's. Each
engine runs in its own process so that its memory is sized alone. `summary` prints the
ratios and a table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from meshserve.bench.engine import random_prompts, sharegpt_like_lengths, throughput_report
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.lora.hook import LoraHook
from meshserve.shared.lora_config import TARGET_MODULES, lora_id_for
from meshserve.shared.sampling_params import SamplingParams

TARGET_RATIO = 0.8  # adapters' throughput against the base model's (docs/lora.md)


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapters(model: Path, out: Path, count: int, rank: int) -> list[str]:
    """`count` random rank-`rank` PEFT adapters of every projection; their names."""
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    shapes = _shapes(config)
    names = []
    for i in range(count):
        folder = out / f"lora{i}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(TARGET_MODULES), "lora_dropout": 0.0}))
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") \
                    else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(
                    rank, fan_in, generator=generator) / math.sqrt(fan_in)).bfloat16()
                # Unit gain (see the module's docstring): smaller B leaves dummy tokens as is.
                tensors[f"{key}.lora_B.weight"] = (torch.randn(
                    fan_out, rank, generator=generator) / math.sqrt(rank)).bfloat16()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        names.append(folder.name)
    return names


def check_kernels(out: Path) -> None:
    """The Triton kernels against the grouped reference on the GPU, at 8B-layer shapes."""
    from meshserve.kernels.lora import LoraBatch, add_lora_reference, group_rows
    from meshserve.kernels.triton_lora import add_lora

    device = torch.device("cuda")
    cases = []
    for tokens, slots, k, slices, rank in [
            (1, 8, 4096, (4096, 1024, 1024), 16), (64, 8, 4096, (14336, 14336), 16),
            (256, 8, 14336, (4096,), 16), (2048, 8, 4096, (4096, 1024, 1024), 16),
            (300, 4, 4096, (4096,), 64)]:
        g = torch.Generator(device=device).manual_seed(tokens)
        row_slots = torch.randint(-1, slots, (tokens,), generator=g, device=device).tolist()
        x = torch.randn(tokens, k, device=device, generator=g).bfloat16()
        a = (torch.randn(slots, len(slices) * rank, k, device=device, generator=g)
             / math.sqrt(k)).bfloat16()
        b = (torch.randn(slots, sum(slices), rank, device=device, generator=g) * 0.1).bfloat16()
        y = torch.randn(tokens, sum(slices), device=device, generator=g).bfloat16()
        rows, starts, counts = group_rows(row_slots, slots)
        batch = LoraBatch(torch.tensor(rows + [0] * (tokens - len(rows)), dtype=torch.int32,
                                       device=device),
                          torch.tensor(starts, dtype=torch.int32, device=device),
                          torch.tensor(counts, dtype=torch.int32, device=device))
        expected = y.clone()
        add_lora_reference(expected, x, a, b, slices, batch)
        add_lora(y, x, a, b, slices, batch)
        error = (y.float() - expected.float()).norm() / expected.float().norm()
        cases.append({"tokens": tokens, "slots": slots, "k": k, "slices": list(slices),
                      "rank": rank, "rel_err": float(error), "ok": bool(error < 1e-2)})
        print(cases[-1], flush=True)
    out.write_text(json.dumps({"cases": cases, "ok": all(c["ok"] for c in cases)}, indent=2))
    assert all(c["ok"] for c in cases), "a LoRA kernel case is off the reference"


def _engine(args: argparse.Namespace) -> LLMEngine:
    lora: dict[str, Any] = {}
    if args.adapters:
        modules = [{"name": f"lora{i}", "path": str(Path(args.adapters) / f"lora{i}")}
                   for i in range(args.count)]
        lora = {"enable_lora": True, "max_loras": args.count, "max_lora_rank": args.rank,
                "lora_modules": json.dumps(modules)}
    return build_engine(EngineConfig(model=args.model, load_format=args.load_format,
                                     dtype=args.dtype, max_model_len=args.max_model_len,
                                     structured_outputs_backend="none",
                                     device=args.device, num_kv_blocks=args.num_kv_blocks,
                                     enforce_eager=args.enforce_eager,
                                     quantization=args.quantization, **lora))


def _throughput(engine: LLMEngine, prompts: list[list[int]], outputs: list[int],
                loras: list[int | None], tag: str) -> dict[str, Any]:
    started = time.perf_counter()
    for i, (prompt, out, lora) in enumerate(zip(prompts, outputs, loras, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=out, ignore_eos=True), lora_id=lora)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - started
    assert tokens == sum(outputs), f"{tag}: {tokens} tokens, expected {sum(outputs)}"
    report = throughput_report(len(prompts), sum(map(len, prompts)), tokens, elapsed)
    print(f"{tag}: {report['output_tokens_per_s']:.0f} output tok/s", flush=True)
    return report


def _tpot(engine: LLMEngine, prompt: list[int], output_len: int, lora: int | None,
          tag: str) -> dict[str, float]:
    """Single-stream decode: (e2e - ttft) / (output_len - 1), best of 3."""
    best = math.inf
    for run in range(3):
        first = None
        engine.add_request(f"{tag}-{run}", prompt, SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True), lora_id=lora)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        assert first is not None
        best = min(best, (time.perf_counter() - first) / (output_len - 1))
    print(f"{tag}: {best * 1e3:.2f} ms per output token", flush=True)
    return {"tpot_ms": best * 1e3}


def _greedy(engine: LLMEngine, prompts: list[list[int]], loras: list[int | None],
            tag: str, max_tokens: int = 32) -> list[list[int]]:
    """Greedy tokens of the prompts run together in one batch."""
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True), lora_id=lora)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def first_logits(engine: LLMEngine, prompt: list[int], lora: int | None,
                 tag: str) -> torch.Tensor:
    """Logits [V] (float32, on the host) of the first generated position of `prompt`."""
    model = engine.model
    compute = model.compute_logits
    seen: list[torch.Tensor] = []

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)  # [rows, V]
        seen.append(logits.float().cpu())
        return logits

    model.compute_logits = record  # an instance attribute, dropped again below
    try:
        _greedy(engine, [prompt], [lora], tag, max_tokens=1)
    finally:
        del model.compute_logits
    # The prefill's call; an async engine may also launch a step that nobody reads.
    assert seen and seen[0].shape[0] == 1, f"{tag}: logits of {len(seen)} calls"
    return seen[0][0]


def _logit_stats(adapters: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """How far the adapters' first-position logits [n, V] are from the base model's [V],
    against the scale of the base logits (their spread and the top-2 gap, which a change
    must exceed to flip a greedy token)."""
    top = base.topk(2).values
    return {"max_logit_diff": float((adapters - base).abs().max()),
            "base_logit_std": float(base.std()),
            "base_top2_gap": float(top[0] - top[1]),
            "argmax_differs": float((adapters.argmax(dim=1) != base.argmax()).float().mean())}


def consistency(engine: LLMEngine, ids: list[int], *, with_reference: bool = False,
                ) -> tuple[dict[str, float], torch.Tensor]:
    """Whether the adapters are applied, and the same way in every batch.

    Each adapter's greedy tokens alone (decode graph of one row) against the same requests in
    one mixed batch with the base model (a bigger graph, other rows' slots): the fraction of
    equal sequences (bf16 GEMMs of other shapes may flip a rare near-tie), and the fraction
    that differ from the base model's. Then the direct signal: first-position logits of each
    adapter against the base model's (`_logit_stats`). `with_reference` (eager engines only:
    graphs replay what they captured) also runs the adapters through the grouped torch path
    and reports the max |logit difference| of the kernels against it. Returns the figures and
    the first-position logits [1 + n, V] (base first)."""
    prompts = random_prompts([64] * len(ids), engine.model_config, 3)
    alone = [_greedy(engine, [p], [i], f"alone{n}")[0] for n, (p, i) in
             enumerate(zip(prompts, ids, strict=True))]
    mixed = _greedy(engine, prompts + prompts, [*ids, *([None] * len(ids))], "mixed")
    together, base = mixed[:len(ids)], mixed[len(ids):]
    result = {"same_alone_and_mixed": sum(a == t for a, t in zip(alone, together,
                                                                  strict=True)) / len(ids),
              "differs_from_base": sum(a != b for a, b in zip(alone, base,
                                                               strict=True)) / len(ids)}
    base_logits = first_logits(engine, prompts[0], None, "logits-base")
    lora_logits = torch.stack([first_logits(engine, prompts[0], i, f"logits{n}")
                               for n, i in enumerate(ids)])  # [n, V]
    result.update(_logit_stats(lora_logits, base_logits))
    if with_reference:
        from meshserve.kernels.lora import add_lora_reference
        from meshserve.services.worker.lora import stack

        kernel = stack.add_lora
        stack.add_lora = add_lora_reference  # what the hooks call, for these runs only
        try:
            reference = torch.stack([first_logits(engine, prompts[0], i, f"reference{n}")
                                     for n, i in enumerate(ids)])
        finally:
            stack.add_lora = kernel
        result["kernel_vs_reference_max_logit_diff"] = float(
            (lora_logits - reference).abs().max())
    print(f"consistency: {result}", flush=True)
    return result, torch.cat([base_logits[None], lora_logits])


def _passes(engine: LLMEngine, prompts: list[list[int]], outputs: list[int],
            loras: list[int | None], tag: str, passes: int) -> dict[str, Any]:
    """The mean report of `passes` runs of the same requests, each run's kept in `passes`."""
    runs = [_throughput(engine, prompts, outputs, loras, f"{tag}{n}") for n in range(passes)]
    mean = {key: sum(r[key] for r in runs) / passes for key in runs[0]
            if isinstance(runs[0][key], (int, float))}
    return {**runs[0], **mean, "passes": runs}


def run(args: argparse.Namespace) -> None:
    engine = _engine(args)
    config = engine.model_config
    ids = [lora_id_for(f"lora{i}") for i in range(args.count)] if args.adapters else []
    lora = engine.hook(LoraHook)
    report: dict[str, Any] = {"command": vars(args), "environment": {
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda"
        else platform.processor(), "torch": torch.__version__,
        "cuda_graphs": engine.graph_report is not None,
        "lora_slot_mib": None if lora is None else round(
            lora.manager.stack.num_bytes / 2**20, 1)}}
    if args.consistency_only:
        assert ids, "--consistency-only needs --adapters"
        report["consistency"], logits = consistency(engine, ids,
                                                    with_reference=args.enforce_eager)
        torch.save(logits, f"{args.out}.logits.pt")
        Path(args.out).write_text(json.dumps(report, indent=2))
        return
    lengths = sharegpt_like_lengths(args.num_prompts, 0, engine.max_model_len)
    prompts = random_prompts([i for i, _ in lengths], config, 0)
    outputs = [o for _, o in lengths]
    # Warm-up: a short batch of every kind (kernels compile, the adapters go to their slots).
    warm = random_prompts([i for i, _ in lengths[:64]], config, 1)
    _throughput(engine, warm, [16] * len(warm), [None] * len(warm), "warm-base")
    if ids:
        _throughput(engine, warm, [16] * len(warm), [ids[i % len(ids)] for i in
                                                     range(len(warm))], "warm-lora")
    save = Path(args.out).write_text  # after every part: a step cut by its limit keeps some
    if ids:  # first: the check matters most when a slow run is cut short
        report["consistency"], logits = consistency(engine, ids)
        torch.save(logits, f"{args.out}.logits.pt")
        save(json.dumps(report, indent=2))
    report["tput_base"] = _passes(engine, prompts, outputs, [None] * len(prompts), "base",
                                  args.passes)
    save(json.dumps(report, indent=2))
    if ids:
        spread = [ids[i % len(ids)] for i in range(len(prompts))]
        report["tput_lora"] = _passes(engine, prompts, outputs, spread, "lora", args.passes)
        save(json.dumps(report, indent=2))
    single = random_prompts([args.single_input_len], config, 2)[0]
    report["tpot_base"] = _tpot(engine, single, args.single_output_len, None, "tpot-base")
    if ids:
        report["tpot_lora"] = _tpot(engine, single, args.single_output_len, ids[0],
                                    "tpot-lora")
    save(json.dumps(report, indent=2))


def _check_lines(name: str, checks: dict[str, float]) -> list[str]:
    line = (f"{name}: greedy tokens of an adapter alone = in a mixed batch for "
             f"{checks.get('same_alone_and_mixed', 0):.0%} of adapters, differ from the base "
             f"model for {checks.get('differs_from_base', 0):.0%}; first position: max "
             f"|logit diff| adapter vs base {checks.get('max_logit_diff', float('nan')):.3g} "
             f"(base logits std {checks.get('base_logit_std', float('nan')):.3g}, top-2 gap "
             f"{checks.get('base_top2_gap', float('nan')):.3g}), argmax differs for "
             f"{checks.get('argmax_differs', 0):.0%}")
    lines = [line]
    if "kernel_vs_reference_max_logit_diff" in checks:
        lines.append(f"{name}: Triton kernels vs grouped torch path, max |logit diff| "
                     f"{checks['kernel_vs_reference_max_logit_diff']:.3g}")
    return lines


def _table(base: dict[str, Any], lora: dict[str, Any]) -> tuple[list[str], float | None]:
    """The table's lines and the adapters / base ratio; parts a cut-short run lacks show
    as "-"."""
    adapters = f"LoRA engine, {lora['command']['count']} adapters (rank {lora['command']['rank']})"
    rows = [("no-LoRA engine, base requests", base, "tput_base", "tpot_base"),
            ("LoRA engine, base requests", lora, "tput_base", "tpot_base"),
            (adapters, lora, "tput_lora", "tpot_lora")]
    reference = base.get("tput_base", {}).get("output_tokens_per_s")
    lines = ["| engine / requests | output tok/s | vs no-LoRA | single-stream TPOT ms |",
             "|---|---|---|---|"]
    for name, report, tput, tpot in rows:
        rate = report.get(tput, {}).get("output_tokens_per_s")
        ms = report.get(tpot, {}).get("tpot_ms")
        cells = [name, "-" if rate is None else f"{rate:.0f}",
                 "-" if rate is None or not reference else f"{rate / reference:.3f}",
                 "-" if ms is None else f"{ms:.2f}"]
        lines.append(f"| {' | '.join(cells)} |")
    rate = lora.get("tput_lora", {}).get("output_tokens_per_s")
    return lines, None if rate is None or not reference else rate / reference


def summary(args: argparse.Namespace) -> None:
    base = json.loads(Path(args.base).read_text()) if Path(args.base).is_file() else {}
    lora = json.loads(Path(args.lora).read_text())
    table, ratio = _table(base, lora)
    lines = [f"device: {lora['environment']['device']}", "",
             f"output tok/s: mean of {lora['command']['passes']} passes", "", *table]
    lines += ["", *_check_lines("CUDA graphs", lora.get("consistency", {}))]
    result: dict[str, Any] = {"base": base, "lora": lora, "ratio": ratio}
    if args.eager and Path(args.eager).is_file():
        eager = json.loads(Path(args.eager).read_text())
        result["eager"] = eager
        lines += _check_lines("eager", eager.get("consistency", {}))
        graphs_logits = Path(f"{args.lora}.logits.pt")
        eager_logits = Path(f"{args.eager}.logits.pt")
        if graphs_logits.is_file() and eager_logits.is_file():
            diff = (torch.load(graphs_logits) - torch.load(eager_logits)).abs()  # [1 + n, V]
            result["graphs_vs_eager_max_logit_diff"] = {"base": float(diff[0].max()),
                                                        "adapters": float(diff[1:].max())}
            lines.append(f"CUDA graphs vs eager, first-position max |logit diff|: base "
                         f"{float(diff[0].max()):.3g}, adapters {float(diff[1:].max()):.3g}")
    shown = "-" if ratio is None else f"{ratio:.3f}"
    verdict = "-" if ratio is None else "met" if ratio >= TARGET_RATIO else "NOT met"
    lines += ["", f"adapters / base throughput: {shown} (target >= {TARGET_RATIO}: {verdict})"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out_md).write_text(text)
    Path(args.out_json).write_text(json.dumps(result, indent=2))


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    adapters = commands.add_parser("adapters")
    adapters.add_argument("--model", required=True)
    adapters.add_argument("--out", required=True)
    adapters.add_argument("--count", type=int, default=8)
    adapters.add_argument("--rank", type=int, default=16)
    check = commands.add_parser("check")
    check.add_argument("--out", required=True)
    bench = commands.add_parser("run")
    bench.add_argument("--model", required=True)
    bench.add_argument("--load-format", default="auto")
    bench.add_argument("--dtype", default="auto")
    bench.add_argument("--max-model-len", type=int, default=2048)
    bench.add_argument("--adapters", default=None, help="folder of `adapters` (unset: no LoRA)")
    bench.add_argument("--count", type=int, default=8)
    bench.add_argument("--rank", type=int, default=16)
    bench.add_argument("--num-prompts", type=int, default=1000)
    bench.add_argument("--single-input-len", type=int, default=128)
    bench.add_argument("--single-output-len", type=int, default=128)
    bench.add_argument("--device", default="auto")
    bench.add_argument("--num-kv-blocks", type=int, default=None, help="unset: sized to memory")
    bench.add_argument("--passes", type=int, default=2, help="throughput passes (mean)")
    bench.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    bench.add_argument("--quantization", choices=["fp8"], default=None,
                       help="the base model's weights in FP8 (the adapters stay in --dtype)")
    bench.add_argument("--consistency-only", action="store_true",
                       help="only the adapters' consistency check (needs --adapters)")
    bench.add_argument("--out", required=True)
    report = commands.add_parser("summary")
    report.add_argument("--base", required=True)
    report.add_argument("--lora", required=True)
    report.add_argument("--out-md", required=True)
    report.add_argument("--out-json", required=True)
    report.add_argument("--eager", default=None, help="a --consistency-only --enforce-eager "
                        "run's JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.command == "adapters":
        print(write_adapters(Path(args.model), Path(args.out), args.count, args.rank))
    elif args.command == "check":
        check_kernels(Path(args.out))
    elif args.command == "run":
        run(args)
    else:
        summary(args)


if __name__ == "__main__":
    main()
