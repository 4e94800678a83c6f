"""Every skinny FP8 launch shape against the torch reference, eagerly, at a few row counts
and weight shapes (a check of the split-K reduction outside the engine).

Driver part: `fp8` (FP8_RUNS=head).

    python3 loadtest/fp8_split_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = ((6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch

    from meshserve.kernels.fp8_linear import fp8_linear_reference, quantize_per_channel
    from meshserve.kernels.triton_fp8_linear import CANDIDATES, skinny_fp8_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        w, scale = quantize_per_channel(
            torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)
        for rows in (1, 2, 5, 8, 16):
            x = torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16)
            ref = fp8_linear_reference(x.float(), w, scale).float()
            for c in CANDIDATES:
                if c.mode == "fma" and rows != 1:
                    continue
                for repeat in range(3):
                    got = skinny_fp8_linear(x, w, scale, c).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    rows_out.append({"n": n, "k": k, "rows": rows, "config": str(c),
                                     "repeat": repeat, "rel_err": err})
                    if not err <= 1e-2:
                        print(f"BAD n={n} k={k} rows={rows} {c} repeat {repeat}: {err:.4g}",
                              flush=True)
    bad = [r for r in rows_out if not r["rel_err"] <= 1e-2]
    print(f"{len(rows_out)} launches, {len(bad)} off by more than 1%", flush=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0),
                                    "launches": rows_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
