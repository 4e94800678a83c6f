"""The mesh against the in-process engine, figure by figure, from one gpu_suite.sh run.

Driver part: `mesh`.

    python loadtest/mesh_report.py --run-dir RUN_DIR --out mesh_report.json --summary mesh.md

Reads the in-process results (`sharegpt.json`: `meshserve bench throughput`, 1000
ShareGPT-like requests at once, with per-request TTFT/ITL; `latency.json`: one stream) and
the mesh results of loadtest/gpu_mesh.sh (`mesh_sharegpt.json`, `mesh_sweep_C.json`,
`mesh_latency.json`, the worker's `worker_steps.jsonl.*` in --mesh-dir), and checks them against the issue's
targets: mesh throughput >= 0.92x in process, TTFT and ITL p50 within 1.2x, single-stream
TPOT <= 1.05x, throughput never falling as concurrency rises, no failed request. Prints a
markdown table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from pathlib import Path
from typing import Any

THROUGHPUT_RATIO = 0.92
LATENCY_RATIO = 1.2
TPOT_RATIO = 1.05
LARGE_BATCH = 512  # running sequences from which a step counts as a large-batch one


def load(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def serve_result(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The one result of a `bench serve` JSON (a sweep's first point)."""
    if doc is None:
        return None
    results = doc.get("results")
    if isinstance(results, list):
        return results[0] if results else None
    return doc


def check(value: float | None, target: float, *, at_least: bool) -> str:
    if value is None:
        return "not measured"
    ok = value >= target if at_least else value <= target
    return f"{'meets' if ok else 'MISSES'} {'>=' if at_least else '<='} {target}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def load_steps(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a --step-trace file (gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:  # type: ignore[operator]
        return [json.loads(line) for line in lines if line.strip()]


def timed_window(steps: list[dict[str, Any]], *, warmed_up: bool, requests: int,
                 tokens: int) -> list[dict[str, Any]]:
    """The worker's steps of the 1000-request run: from the first step of the burst of adds
    that brought its requests (the second such burst when an equally big warm-up came
    first) until its tokens are out."""
    groups: list[tuple[int, int]] = []  # (first step, requests added) of runs of adds
    last_add_end = -1e9
    for i, step in enumerate(steps):
        if not step["added"]:
            continue
        if step["end_s"] - last_add_end > 1.0:
            groups.append((i, 0))
        first, added = groups[-1]
        groups[-1] = (first, added + step["added"])
        last_add_end = step["end_s"]
    bursts = [first for first, added in groups if added >= requests // 2]
    wanted = 1 if warmed_up else 0
    if len(bursts) <= wanted:
        return []
    start = bursts[wanted]
    produced, end = 0, start
    while end < len(steps) and produced < tokens:
        produced += steps[end]["tokens"]
        end += 1
    return steps[start:end]


def engine_figures(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """Steps, time inside them and tokens of a window of engine steps."""
    if not steps:
        return None
    busy = sum(s["duration_s"] for s in steps)
    wall = steps[-1]["end_s"] - (steps[0]["end_s"] - steps[0]["duration_s"])
    tokens = sum(s["tokens"] for s in steps)
    figures = {"steps": len(steps), "tokens": tokens, "wall_s": wall, "busy_s": busy,
               "mean_step_ms": 1e3 * busy / len(steps), "tokens_per_step": tokens / len(steps),
               "busy_fraction": busy / wall if wall else 0.0}
    large = [s for s in steps if s["running"] >= LARGE_BATCH]
    if large:  # where the mesh's steps have come out longer than in process
        figures["large_batch_steps"] = len(large)
        figures["large_batch_step_ms"] = 1e3 * sum(s["duration_s"] for s in large) / len(large)
    # The device's own time (traces of a GPU run since the device timeline): its work,
    # its idle gaps waiting for the host, and the KV tier's gathers.
    if any(s.get("device_busy_s") for s in steps):  # zero throughout on a CPU
        for key in ("device_busy_s", "device_idle_s", "tier_s"):
            figures[key] = sum(s.get(key, 0.0) for s in steps)
    return figures


def worker_figures(mesh_dir: Path, mesh: dict[str, Any] | None) -> dict[str, float] | None:
    """The worker's engine during the 1000-request run, from its step trace."""
    traces = sorted(mesh_dir.glob("worker_steps.jsonl*"))
    if not traces or mesh is None:
        return None
    warmed_up = int(mesh.get("config", {}).get("num_warmup", 0)) >= 100
    return engine_figures(timed_window(load_steps(traces[0]), warmed_up=warmed_up,
                                       requests=int(mesh["completed"]),
                                       tokens=int(mesh["total_output_tokens"])))


def summary(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """A result without its per-request arrays (they stay in the run's own JSON files)."""
    if result is None:
        return None
    return {k: v for k, v in result.items() if not (isinstance(v, list) and len(v) > 16)}


def build(run_dir: Path, mesh_dir: Path) -> dict[str, Any]:
    inproc = load(run_dir / "sharegpt.json")
    latency = load(run_dir / "latency.json")
    mesh = serve_result(load(mesh_dir / "mesh_sharegpt.json"))
    single = serve_result(load(mesh_dir / "mesh_latency.json"))
    sweep = []
    for path in sorted(mesh_dir.glob("mesh_sweep_*.json"),
                       key=lambda p: int(p.stem.rsplit("_", 1)[1])):
        point = serve_result(load(path))
        if point is not None:
            sweep.append(point)
    figures: dict[str, Any] = {"in_process": summary(inproc), "mesh": summary(mesh),
                               "single_stream": summary(single),
                               "sweep": [summary(p) for p in sweep],
                               "worker": worker_figures(mesh_dir, mesh),
                               "in_process_engine": engine_figures(
                                   load_steps(run_dir / "sharegpt_steps.jsonl")
                                   if (run_dir / "sharegpt_steps.jsonl").is_file() else [])}
    rows: list[tuple[str, str, str, str]] = []
    if inproc and mesh:
        tput = ratio(mesh["output_throughput"], inproc["output_tokens_per_s"])
        ttft = ratio(mesh["median_ttft_ms"], inproc.get("median_ttft_ms"))
        itl = ratio(mesh["median_itl_ms"], inproc.get("median_itl_ms"))
        rows += [
            ("output tok/s, 1000 at once", f"{inproc['output_tokens_per_s']:.0f}",
             (f"{mesh['output_throughput']:.0f} ({mesh['completed']} done, "
              f"{mesh['failed']} failed)"),
             f"{tput:.3f}x: {check(tput, THROUGHPUT_RATIO, at_least=True)}"),
            ("TTFT p50 (ms)", _fmt(inproc.get("median_ttft_ms")), _fmt(mesh["median_ttft_ms"]),
             _ratio_text(ttft, LATENCY_RATIO)),
            ("ITL p50 (ms)", _fmt(inproc.get("median_itl_ms")), _fmt(mesh["median_itl_ms"]),
             _ratio_text(itl, LATENCY_RATIO)),
            ("ITL p99 (ms)", _fmt(inproc.get("p99_itl_ms")), _fmt(mesh["p99_itl_ms"]), ""),
        ]
        figures.update(throughput_ratio=tput, ttft_p50_ratio=ttft, itl_p50_ratio=itl)
    if latency and single:
        inproc_tpot = latency["tpot_s"]["avg"] * 1e3
        tpot = ratio(single["mean_tpot_ms"], inproc_tpot)
        rows.append(("single-stream TPOT (ms)", _fmt(inproc_tpot),
                     _fmt(single["mean_tpot_ms"]), _ratio_text(tpot, TPOT_RATIO)))
        figures["tpot_ratio"] = tpot
    if sweep:
        rates = [p["output_throughput"] for p in sweep]
        never_falls = all(b >= a for a, b in itertools.pairwise(rates))
        figures["sweep_never_falls"] = never_falls
        points = ", ".join(f"{p['max_concurrency']}: {p['output_throughput']:.0f} tok/s "
                           f"(ITL p50 {p['median_itl_ms']:.1f} ms, {p['failed']} failed)"
                           for p in sweep)
        rows.append(("sweep, output tok/s by concurrency", "", points,
                     "never falls" if never_falls else "FALLS somewhere"))
    worker, engine = figures["worker"], figures["in_process_engine"]
    if worker:
        inproc_text = "" if engine is None else (
            f"{engine['steps']} steps, {engine['busy_s']:.2f} s in them, "
            f"{engine['mean_step_ms']:.1f} ms each")
        busy_ratio = None if engine is None else ratio(worker["busy_s"], engine["busy_s"])
        figures["engine_time_ratio"] = busy_ratio
        rows.append(("engine during the 1000-request run", inproc_text,
                     (f"{worker['steps']} steps, {worker['busy_s']:.2f} s in them, "
                      f"{worker['mean_step_ms']:.1f} ms each, busy "
                      f"{100 * worker['busy_fraction']:.1f}% of its {worker['wall_s']:.1f} s"),
                     "-" if busy_ratio is None else
                     f"time in steps {busy_ratio:.3f}x in process (the gRPC side's cost to "
                     f"the engine loop; target <= 1.05)"))
        if engine is not None and "device_busy_s" in worker and "device_busy_s" in engine:
            device_ratio = ratio(worker["device_busy_s"], engine["device_busy_s"])
            label = "device during that run: work / idle / KV tier gathers (s); large batches"
            rows.append((label, _device_text(engine), _device_text(worker),
                         f"device work {device_ratio:.3f}x in process"))
    failed = sum(p.get("failed", 0) for p in [mesh, single, *sweep] if p)
    figures["failed_requests"] = failed
    rows.append(("failed requests, all mesh runs", "", str(failed),
                 "none" if failed == 0 else "SOME FAILED"))
    figures["rows"] = rows
    return figures


def plot_sweep(mesh_dir: Path, path: Path) -> None:
    """The sweep's PNG, drawn as `meshserve bench serve --plot` draws a sweep."""
    from meshserve.bench.serve.plot import require_matplotlib, write_plot

    require_matplotlib()
    points = [serve_result(load(p)) for p in sorted(
        mesh_dir.glob("mesh_sweep_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))]
    write_plot(path, [p for p in points if p is not None], sweep=True)


def _device_text(figures: dict[str, float]) -> str:
    text = (f"{figures['device_busy_s']:.2f} / {figures['device_idle_s']:.2f} / "
            f"{figures.get('tier_s', 0.0):.2f}")
    if "large_batch_step_ms" in figures:
        text += (f"; {figures['large_batch_steps']} of {LARGE_BATCH}+ running, "
                 f"{figures['large_batch_step_ms']:.1f} ms each")
    return text


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio_text(value: float | None, target: float) -> str:
    return "-" if value is None else f"{value:.3f}x: {check(value, target, at_least=False)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True,
                        help="the suite's run folder (the in-process results)")
    parser.add_argument("--mesh-dir", type=Path, default=None,
                        help="gpu_mesh.sh's output folder (default: RUN_DIR/mesh)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summary", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw the sweep (throughput and ITL against concurrency, "
                             "latency CDFs) into this PNG; needs matplotlib")
    args = parser.parse_args()
    mesh_dir = args.mesh_dir or args.run_dir / "mesh"
    figures = build(args.run_dir, mesh_dir)
    if args.plot is not None:
        plot_sweep(mesh_dir, args.plot)
    lines = ["| figure | in process | through the mesh | against the target |",
             "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in figures["rows"]]
    table = "\n".join(lines)
    print(table)
    args.out.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    if args.summary is not None:
        args.summary.write_text(table + "\n")


if __name__ == "__main__":
    main()
