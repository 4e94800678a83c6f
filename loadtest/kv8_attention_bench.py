"""Decode attention over a bf16 and an FP8 KV cache, on one CUDA GPU, across launch tiles.

Driver part: `fp8` (FP8_RUNS=widen).

    python loadtest/kv8_attention_bench.py --out kv8_attention.json

For each (sequences, context) case a cache of random keys and values is laid out with
shuffled block tables (as a long-running server's cache is), copied to float8_e4m3fn, and one
decode step of paged attention (the Llama-3.1-8B head layout: 32 query heads, 8 KV heads,
head dim 128) is timed over both caches with every tile shape of TILES (microseconds per call,
median of `triton.testing.do_bench`). The KV bytes a call reads over its time is the rate to
compare with the memory's. The FP8 cache is timed twice: "fp8" widens e4m3 with Hopper's
conversion instruction, "fp8bits" with integer instructions (kernels/fp8_widen.py; the
engine's default). The FP8 results are checked against attention over the widened FP8
values (the same inputs), the two widenings against each other (the same bits), and the
default tiles' bf16 result against the FP8 one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from meshserve.kernels import knobs, triton_attention
from meshserve.kernels.attention import AttentionMetadata, decode_attention_reference
from meshserve.kernels.triton_attention import AttentionTiles

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TILES = [AttentionTiles(block_m=16, tile_n=n, num_warps=w, num_stages=s)
         for n in (64, 128, 256) for w in (4, 8) for s in (2, 3, 4)]


def case(num_seqs: int, context: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(num_seqs * 7 + context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k16 = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    v16 = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    k8, v8 = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
    tables = torch.randperm(num_blocks, generator=g, device=device).view(
        num_seqs, blocks_per_seq).to(torch.int32)
    seq_lens = [context] * num_seqs
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_seqs,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=1, max_seq_len=context,
        query_lens_cpu=[1] * num_seqs, seq_lens_cpu=seq_lens)
    query = torch.randn(num_seqs, NUM_Q_HEADS, HEAD_DIM, generator=g, device=device,
                        dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    import triton.testing

    rows = []
    caches = (("bf16", (k16, v16), "bits"), ("fp8", (k8, v8), "cvt"),
              ("fp8bits", (k8, v8), "bits"))
    for cache, (k, v), widen in caches:
        knobs.use(dataclasses.replace(knobs.current(), fp8_widen=widen))
        kv_bytes = 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * k.element_size()
        for tiles in TILES:
            def run(k=k, v=v, tiles=tiles) -> torch.Tensor:
                return triton_attention.paged_attention(query, k, v, meta, scale, tiles=tiles)
            try:
                us = 1e3 * triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a shape that does not fit: noted
                rows.append({"cache": cache, "tiles": vars(tiles), "error": repr(exc)[:200]})
                continue
            rows.append({"cache": cache, "tiles": vars(tiles), "us": us,
                         "kv_gb_per_s": kv_bytes / us / 1e3})
    # Correctness: FP8 against the widened FP8 values, the two widenings against each other,
    # bf16 default against FP8 default.
    knobs.use(dataclasses.replace(knobs.current(), fp8_widen="cvt"))
    cvt_out = triton_attention.paged_attention(query, k8, v8, meta, scale).float()
    knobs.use(dataclasses.replace(knobs.current(), fp8_widen="bits"))
    fp8_out = triton_attention.paged_attention(query, k8, v8, meta, scale).float()
    wide = decode_attention_reference(query.float(), k8.float(), v8.float(), meta, scale)
    bf16_out = triton_attention.paged_attention(query, k16, v16, meta, scale).float()
    best = {c: min((r for r in rows if r["cache"] == c and "us" in r), key=lambda r: r["us"])
            for c, _, _ in caches}
    default = {c: next(r for r in rows if r["cache"] == c and "us" in r
                       and r["tiles"] == vars(triton_attention.DECODE_TILES)) for c in best}
    return {"num_seqs": num_seqs, "context": context, "rows": rows, "best": best,
            "default": default,
            "fp8_vs_widened_max_abs_err": (fp8_out - wide).abs().max().item(),
            "bits_equal_cvt": bool(torch.equal(fp8_out, cvt_out)),
            "fp8_vs_bf16_max_abs_diff": (fp8_out - bf16_out).abs().max().item()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default="768x640,256x2048,64x4096",
                   help="SEQSxCONTEXT entries, comma-separated")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "cases": []}
    import triton

    results["triton"] = triton.__version__
    for entry in args.cases.split(","):
        seqs, context = (int(x) for x in entry.split("x"))
        r = case(seqs, context, device)
        results["cases"].append(r)
        b, f = r["best"], r["default"]
        print(f"{seqs} seqs x {context}: default tiles bf16 {f['bf16']['us']:.0f} us "
              f"({f['bf16']['kv_gb_per_s']:.0f} GB/s), fp8 {f['fp8']['us']:.0f} us "
              f"({f['fp8']['kv_gb_per_s']:.0f} GB/s), fp8 by bits {f['fp8bits']['us']:.0f} us "
              f"({f['fp8bits']['kv_gb_per_s']:.0f} GB/s); best bf16 {b['bf16']['us']:.0f} us "
              f"{b['bf16']['tiles']}, best fp8 {b['fp8']['us']:.0f} us {b['fp8']['tiles']}, "
              f"best fp8 by bits {b['fp8bits']['us']:.0f} us {b['fp8bits']['tiles']}; "
              f"fp8 err {r['fp8_vs_widened_max_abs_err']:.2e}, bits == cvt "
              f"{r['bits_equal_cvt']}", flush=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
