"""Per-shape times of the bf16 and FP8 products for the Llama-3.1-8B layers (gpu_fp8.sh).

Driver part: `fp8` (FP8_RUNS base, head, widen) and `profile`.

    python loadtest/fp8_kernels_bench.py --out kernels.json [--rows 1 8 16 64 256]

For every layer shape (fused qkv, o, gate_up, down) and row count: the bf16 product
(`meshserve.kernels.linear.linear`) and the FP8 one (`fp8_linear`) as the engine runs them,
each timed back to back inside a CUDA graph as the engine runs them (no host launch in the
figure), cycling over copies of the weight that exceed twice the L2 cache, and the weight
bytes per second they reach. `--shapes tp2` times one rank's slices at tensor parallelism 2,
`--shapes lm_head` the 8B LM head (FP8 with --quantize-lm-head). Up to 16 rows the FP8
product is the skinny Triton kernel: the table names
the launch shape `fp8_tuning` chose and the JSON keeps every candidate's time. Past 16 rows
it is per-token quantization + `torch._scaled_mm`: the JSON splits the two and times
`_scaled_mm` with `use_fast_accum` too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# (name, N, K) of the Llama-3.1-8B projections (fused q/k/v and gate/up).
SHAPES = {"tp1": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336)),
          "tp2": (("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096),
                  ("down", 4096, 7168)),
          "lm_head": (("lm_head", 128256, 4096),)}  # --quantize-lm-head


def measure(rows_list: list[int], shapes: str) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, n, k in SHAPES[shapes]:
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16)
            out.append(measure_one(name, x, w))
            print(table_line(out[-1]), flush=True)
    return out


def measure_one(name: str, x: Any, w: Any) -> dict[str, Any]:
    """One shape and row count: the bf16 and FP8 products, and the parts of the FP8 one."""
    import torch

    from meshserve.kernels import fp8_tuning, triton_fp8_linear
    from meshserve.kernels.fp8_linear import SKINNY_MAX_ROWS, fp8_linear, quantize_per_channel
    from meshserve.kernels.linear import linear

    (rows, k), n = x.shape, w.shape[0]
    q, scale = quantize_per_channel(w)
    if rows <= SKINNY_MAX_ROWS:
        fp8_tuning.config_for(x, q, scale)  # the launch shape measured before the timing
    bf16_copies, fp8_copies = fp8_tuning.weight_copies(w), fp8_tuning.weight_copies(q)

    def median_us(fn: Any, copies: list[Any]) -> float:
        calls = max(len(copies), 16 // len(copies) * len(copies))
        return fp8_tuning.graph_time_ms(lambda i: fn(copies[i % len(copies)]), calls,
                                        x.device) * 1e3

    io = rows * (k + n) * 2  # activations in, outputs out (bf16)
    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "rows": rows}
    row["bf16_us"] = median_us(lambda weight: linear(x, weight), bf16_copies)
    row["bf16_gbs"] = (n * k * 2 + io) / row["bf16_us"] / 1e3
    row["fp8_us"] = median_us(lambda weight: fp8_linear(x, weight, scale), fp8_copies)
    row["fp8_gbs"] = (n * k + io) / row["fp8_us"] / 1e3
    if rows <= SKINNY_MAX_ROWS:
        c = fp8_tuning.config_for(x, q, scale)
        row["fp8_path"] = (f"triton {c.mode}{'+bits' if c.widen == 'bits' else ''} "
                           f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"
                           f"{f' split{c.split_k}' if c.split_k > 1 else ''}")
        row["candidates_us"] = {str(c): ms * 1e3 for c, ms in
                                fp8_tuning.measured[(n, k, rows == 1)].items()}
        return row
    xq, xs = triton_fp8_linear.quantize_per_token(x)
    row["fp8_path"] = "quantize + _scaled_mm (fast accum)"
    row["quantize_us"] = median_us(lambda _: triton_fp8_linear.quantize_per_token(x), [x])
    for fast in (False, True):
        row[f"scaled_mm{'_fast_accum' if fast else ''}_us"] = median_us(
            lambda weight, fast=fast: torch._scaled_mm(
                xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1),
                out_dtype=torch.bfloat16, use_fast_accum=fast), fp8_copies)
    return row


HEADER = ("| shape | N | K | rows | bf16 us | bf16 GB/s | fp8 us | fp8 GB/s | fp8/bf16 | "
          "fp8 path |\n|---|---|---|---|---|---|---|---|---|---|")


def table_line(r: dict[str, Any]) -> str:
    extra = ""
    if "quantize_us" in r:
        extra = (f" (quantize {r['quantize_us']:.1f} + mm {r['scaled_mm_us']:.1f}; "
                 f"fast accum mm {r['scaled_mm_fast_accum_us']:.1f})")
    return (f"| {r['shape']} | {r['n']} | {r['k']} | {r['rows']} | {r['bf16_us']:.1f} | "
            f"{r['bf16_gbs']:.0f} | {r['fp8_us']:.1f} | {r['fp8_gbs']:.0f} | "
            f"{r['fp8_us'] / r['bf16_us']:.2f} | {r['fp8_path']}{extra} |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fp8_kernels_bench.py")
    parser.add_argument("--out", type=Path, required=True, help="JSON; a .md table beside it")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="tp1")
    parser.add_argument("--fp8-widen", choices=["cvt", "bits"], default="cvt",
                        help="the engine's --fp8-widen: with bits the tuner also measures "
                             "the launch shapes that widen e4m3 by integer instructions")
    args = parser.parse_args(argv)
    import torch

    from meshserve.kernels import knobs

    knobs.use(knobs.KernelKnobs(fp8_widen=args.fp8_widen))
    if not torch.cuda.is_available():
        print("fp8_kernels_bench: no CUDA device")
        return 1
    print(HEADER, flush=True)
    rows = measure(args.rows, args.shapes)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        HEADER + "\n" + "\n".join(table_line(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
