"""One mixture-of-experts layer on the GPU, timed alone: routing and the experts
(`meshserve.kernels.moe.fused_moe`) at a model's expert shape, for a range of token counts,
each replayed from a CUDA graph as the engine's decode steps are. Prints and writes a JSON row
per token count: microseconds per layer, the bytes the layer must read (the distinct experts
its tokens were routed to, with the activations) and the bandwidth that makes, next to the
device's measured copy bandwidth.

    python3 loadtest/moe_kernel_bench.py --out moe_kernels.json            # Qwen3-30B-A3B
    python3 loadtest/moe_kernel_bench.py --hidden 2880 --inter 2880 --experts 32 --top-k 4
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from triton.errors import TritonError

from meshserve.kernels import triton_moe
from meshserve.kernels.fp8_linear import quantize_per_channel
from meshserve.kernels.moe import fused_moe

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# More arguments of every fused_moe call (the FP8 weights' scales with --fp8).
fused_moe_kwargs: dict[str, torch.Tensor] = {}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read plus write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def time_layer(tokens: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               iters: int) -> tuple[float, int]:
    """(microseconds per call from a CUDA graph, distinct experts routed to)."""
    hidden, experts = w13.shape[2], w13.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(w13.dtype)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    for _ in range(2):  # compile and warm outside the capture
        fused_moe(x, w13, w2, logits, top_k, True, **fused_moe_kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w13, w2, logits, top_k, True, **fused_moe_kwargs)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    distinct = int(torch.topk(logits, top_k, dim=-1).indices.unique().numel())
    return start.elapsed_time(end) * 1e3 / iters, distinct


def sweep(w13: torch.Tensor, w2: torch.Tensor, top_k: int, iters: int,
          which: str) -> dict[str, Any]:
    """Time each matrix-vector block shape (one product at a time, the other at its
    default) at 1 and 4 tokens; keep the shape with the lowest sum in GEMV_CONFIGS. With
    `which` "all" or "grouped", the grouped GEMMs' shapes too ("grouped": those alone)."""
    found: dict[str, Any] = {}
    grouped = which in ("all", "grouped")
    for gate_up in (True, False) if which != "grouped" else ():
        timings = []
        for config in itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8), (1, 3)):
            block_n, block_k, warps, _ = config
            if block_n * block_k // (32 * warps) > 256:  # too many values a thread
                continue
            triton_moe.GEMV_CONFIGS[gate_up] = config
            try:
                total = sum(time_layer(t, w13, w2, top_k, iters // 4)[0] for t in (1, 4))
            except (TritonError, RuntimeError) as error:  # a shape the compiler refuses
                print(f"config {config}: {type(error).__name__}", flush=True)
                continue
            timings.append((total, config))
        best = min(timings)
        triton_moe.GEMV_CONFIGS[gate_up] = best[1]
        found["gate_up" if gate_up else "down"] = {
            "best": list(best[1]), "us_1_plus_4": round(best[0], 2),
            "all": sorted([round(t, 2), list(c)] for t, c in timings)[:12]}
        print(json.dumps(found), flush=True)
    for block_m, tokens in ((16, 256), (32, 512), (64, 1024)) if grouped else ():
        timings = []
        for config in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)):
            triton_moe.GROUPED_CONFIGS[block_m] = config
            try:
                total = time_layer(tokens, w13, w2, top_k, iters // 4)[0]
            except (TritonError, RuntimeError) as error:
                print(f"config {config}: {type(error).__name__}", flush=True)
                continue
            timings.append((total, config))
        best = min(timings)
        triton_moe.GROUPED_CONFIGS[block_m] = best[1]
        found[f"grouped_{block_m}"] = {
            "tokens": tokens, "best": list(best[1]), "us": round(best[0], 2),
            "all": sorted([round(t, 2), list(c)] for t, c in timings)[:8]}
        print(json.dumps(found[f"grouped_{block_m}"]), flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fp8", action="store_true", help="FP8 expert weights")
    parser.add_argument("--sweep", choices=("gemv", "grouped", "all"),
                        help="first time the matrix-vector products' block shapes at 1 and 4 "
                             "tokens (gemv), the grouped GEMMs' at 256, 512 and 1024 "
                             "(grouped) or both (all), and keep the fastest of each")
    args = parser.parse_args()
    dtype = torch.bfloat16
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, device="cuda", dtype=dtype)
    w2 = torch.randn(args.experts, args.hidden, args.inter, device="cuda", dtype=dtype)
    w13 *= args.hidden**-0.5
    w2 *= args.inter**-0.5
    if args.fp8:  # per expert and output row scales, as --quantization fp8 makes them
        w13, w2 = (torch.stack([quantize_per_channel(w[e])[0] for e in range(args.experts)])
                   for w in (w13, w2))
        fused_moe_kwargs.update(
            w13_scale=torch.full(w13.shape[:2], 1e-3, device="cuda"),
            w2_scale=torch.full(w2.shape[:2], 1e-3, device="cuda"))
    bandwidth = copy_bandwidth()
    expert_bytes = 3 * args.hidden * args.inter * w13.element_size()  # 1 a value in FP8
    swept = sweep(w13, w2, args.top_k, args.iters, args.sweep) if args.sweep else {}
    rows = []
    for tokens in args.sizes:
        micros, distinct = time_layer(tokens, w13, w2, args.top_k, args.iters)
        nbytes = distinct * expert_bytes + 2 * tokens * args.hidden * 2  # + bf16 in and out
        floor = nbytes / bandwidth * 1e6
        row = {"tokens": tokens, "us": round(micros, 2), "experts_read": distinct,
               "bytes": nbytes, "floor_us": round(floor, 2), "x_floor": round(micros / floor, 2),
               "tb_per_s": round(nbytes / micros / 1e6, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "copy_tb_per_s": round(bandwidth / 1e12, 3), "shape": vars(args) | {"out": None},
              "gemv_configs": {str(k): v for k, v in triton_moe.GEMV_CONFIGS.items()},
              "grouped_configs": triton_moe.GROUPED_CONFIGS,
              "sweep": swept, "rows": rows}
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s on {result['gpu']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
