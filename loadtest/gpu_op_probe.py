"""Times the candidates for two hot operations of the 8B model on the GPU, to choose between them.

Driver part: none (a GPU probe cited by kernels/linear.py and kernels/triton_attention.py).

1. Skinny matrix products (decode of few sequences): cuBLAS through F.linear (default and
   cuBLASLt preferred) against the Triton kernel of `meshserve.kernels.triton_linear` over a
   grid of launch shapes, for the Llama-3.1-8B projections. Each candidate runs inside a CUDA
   graph over 32 distinct weight matrices (one per layer, as in a decode step), so no weight
   is read from L2 and launch gaps count as they do in a captured step.
2. Causal attention of one 8k-token fresh prompt (prefill): PyTorch's fused attention with
   each backend, with the KV heads repeated or grouped-query attention enabled.
3. Decode attention over the paged cache (`--parts decode_attention`) at ShareGPT-like batch
   sizes and lengths, over a grid of tile shapes.

    python loadtest/gpu_op_probe.py --out $OUT/op_probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshserve.kernels.triton_linear import SkinnyConfig, config_for, skinny_linear

# (name, N, K) of the Llama-3.1-8B projections; the LM head is read once per step.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096)]
LAYERS = 32


def graph_time(calls: list[Callable[[], Any]], reps: int = 10) -> float:
    """Seconds per call of `calls` run back to back inside one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps / len(calls)


def probe_linear(report: dict[str, Any]) -> None:
    configs = [SkinnyConfig(bn, bk, w, s) for bn, bk, w, s in itertools.product(
        (4, 8, 16), (256, 512, 1024), (4, 8), (3, 5))]
    dot_configs = [SkinnyConfig(bn, bk, 4, s) for bn, bk, s in itertools.product(
        (16, 32, 64), (128, 256), (3, 5))]
    results: dict[str, Any] = {}
    for name, n, k in SHAPES:
        copies = 4 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        nbytes = n * k * 2
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            entry: dict[str, Any] = {}
            want = F.linear(x, weights[0]).float()
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                seconds = graph_time([partial(F.linear, x, w) for w in weights])
                entry[f"torch_{library}"] = {"us": seconds * 1e6, "tb_s": nbytes / seconds / 1e12}
            torch.backends.cuda.preferred_blas_library("cublas")
            best: dict[str, Any] | None = None
            tried = []
            for config in configs if rows == 1 else dot_configs:
                try:
                    got = skinny_linear(x, weights[0], config).float()
                    err = ((got - want).norm() / want.norm()).item()
                    seconds = graph_time([partial(skinny_linear, x, w, config)
                                          for w in weights])
                except Exception as exc:  # noqa: BLE001 (a launch shape that does not fit)
                    print(f"{name} m{rows} {config}: {type(exc).__name__}: {exc}"[:300])
                    continue
                row = {"config": config.__dict__, "us": seconds * 1e6,
                       "tb_s": nbytes / seconds / 1e12, "rel_err": err}
                tried.append(row)
                if best is None or row["us"] < best["us"]:
                    best = row
            entry["triton_best"] = best
            entry["triton_all"] = sorted(tried, key=lambda r: r["us"])
            entry["triton_default"] = next(
                (r for r in tried if r["config"] == config_for(rows, n, k).__dict__), None)
            results[f"{name} m{rows}"] = entry
            print(f"{name:8s} m{rows}: cublas {entry['torch_cublas']['us']:8.1f} us "
                  f"({entry['torch_cublas']['tb_s']:.2f} TB/s), cublaslt "
                  f"{entry['torch_cublaslt']['us']:8.1f} us, triton "
                  f"{best['us'] if best else float('nan'):8.1f} us "
                  f"({best['tb_s'] if best else float('nan'):.2f} TB/s) "
                  f"{best['config'] if best else ''} err {best['rel_err'] if best else ''}; "
                  f"config_for: {entry['triton_default']['us'] if entry['triton_default'] else '-'}"
                  f" us", flush=True)
        del weights
        torch.cuda.empty_cache()
    # Per token of batch-1 decode: 32 layers of the four projections and one LM head.
    per_token = {}
    for option in ("torch_cublas", "torch_cublaslt", "triton_best"):
        total = 0.0
        for name, _, _ in SHAPES:
            us = results[f"{name} m1"][option]["us"]
            total += us if name == "lm_head" else LAYERS * us
        per_token[option] = total / 1e3
    best_mix = sum(min(results[f"{name} m1"][o]["us"] for o in ("torch_cublas", "triton_best"))
                   * (1 if name == "lm_head" else LAYERS) for name, _, _ in SHAPES) / 1e3
    per_token["best_of_each"] = best_mix
    print(f"batch-1 GEMM ms per token: {per_token}", flush=True)
    report["linear"] = results
    report["linear_ms_per_token_b1"] = per_token


def probe_attention(report: dict[str, Any]) -> None:
    torch.manual_seed(0)
    t, hq, hkv, d = 8192, 32, 8, 128
    groups = hq // hkv
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    scale = d**-0.5

    def run(backend: SDPBackend, gqa: bool, contiguous: bool) -> torch.Tensor:
        qq = q.transpose(0, 1).unsqueeze(0)
        kk, vv = k.transpose(0, 1), v.transpose(0, 1)
        if not gqa:
            kk, vv = kk.repeat_interleave(groups, dim=0), vv.repeat_interleave(groups, dim=0)
        kk, vv = kk.unsqueeze(0), vv.unsqueeze(0)
        if contiguous:
            qq, kk, vv = qq.contiguous(), kk.contiguous(), vv.contiguous()
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        return o[0].transpose(0, 1).contiguous()

    flops = 4 * hq * d * t * (t + 1) // 2
    reference = run(SDPBackend.FLASH_ATTENTION, False, True).float()
    results = {}
    for backend, gqa, contiguous in itertools.product(
            (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION), (False, True), (False, True)):
        name = f"{backend.name} gqa={gqa} contiguous={contiguous}"
        try:
            out = run(backend, gqa, contiguous).float()
            err = ((out - reference).norm() / reference.norm()).item()
            for _ in range(2):
                run(backend, gqa, contiguous)
            torch.cuda.synchronize()
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            for _ in range(10):
                run(backend, gqa, contiguous)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 10
            results[name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
            print(f"{name:55s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s err {err:.1e}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 (a backend that refuses these inputs)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name:55s} unavailable: {results[name]['error'][:120]}", flush=True)
    report["attention_8k"] = results


def probe_decode_attention(report: dict[str, Any]) -> None:
    """Decode attention over the paged cache at ShareGPT-like batch sizes and context lengths,
    for a grid of tile shapes: time and the KV bandwidth it reaches."""
    from meshserve.kernels import triton_attention
    from meshserve.kernels.attention import AttentionMetadata

    hq, hkv, d, bs = 32, 8, 128, 16
    results: dict[str, Any] = {}
    for num_seqs, lo, hi in ((1000, 150, 450), (100, 400, 1600), (8, 1000, 4000)):
        g = torch.Generator().manual_seed(num_seqs)
        lens = torch.randint(lo, hi, (num_seqs,), generator=g)
        blocks = [-(-int(n) // bs) for n in lens]
        total_blocks = sum(blocks) + 1
        perm = torch.randperm(total_blocks, generator=g)
        width = max(blocks)
        tables = torch.zeros(num_seqs, width, dtype=torch.int32)
        start = 0
        for i, nb in enumerate(blocks):
            tables[i, :nb] = perm[start:start + nb]
            start += nb
        k_cache = torch.randn(total_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(num_seqs, hq, d, device="cuda", dtype=torch.bfloat16)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.long, device="cuda"),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
            seq_lens=lens.to(torch.int32).cuda(), block_tables=tables.cuda(),
            max_query_len=1, max_seq_len=int(lens.max()),
            query_lens_cpu=[1] * num_seqs, seq_lens_cpu=lens.tolist())
        kv_bytes = int(lens.sum()) * hkv * d * 2 * 2
        want = triton_attention.paged_attention(q, k_cache, v_cache, meta, d**-0.5).float()
        rows = []
        for tile_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            tiles = triton_attention.AttentionTiles(block_m=16, tile_n=tile_n, num_warps=warps,
                                                    num_stages=stages)
            try:
                got = triton_attention.paged_attention(q, k_cache, v_cache, meta, d**-0.5,
                                                       tiles=tiles).float()
                err = ((got - want).norm() / want.norm()).item()
                seconds = graph_time([partial(triton_attention.paged_attention, q, k_cache,
                                              v_cache, meta, d**-0.5, tiles=tiles)] * 8)
            except Exception as exc:  # noqa: BLE001 (a tile shape that does not fit)
                print(f"decode b{num_seqs} {tiles}: {type(exc).__name__}"[:200])
                continue
            rows.append({"tile_n": tile_n, "num_warps": warps, "num_stages": stages,
                         "us": seconds * 1e6, "tb_s": kv_bytes / seconds / 1e12,
                         "rel_err": err})
        rows.sort(key=lambda r: r["us"])
        default = triton_attention.default_tiles(d, torch.bfloat16, True)
        now = next(r for r in rows if (r["tile_n"], r["num_warps"], r["num_stages"]) == (
            default.tile_n, default.num_warps, default.num_stages))
        name = f"decode b{num_seqs} ctx {lo}-{hi}"
        results[name] = {"kv_bytes": kv_bytes, "default": now, "all": rows}
        print(f"{name}: default {now['us']:.0f} us ({now['tb_s']:.2f} TB/s); best "
              f"{rows[0]['us']:.0f} us ({rows[0]['tb_s']:.2f} TB/s) tile_n {rows[0]['tile_n']} "
              f"warps {rows[0]['num_warps']} stages {rows[0]['num_stages']}; next "
              f"{[(r['tile_n'], r['num_warps'], r['num_stages'], round(r['us'])) for r in rows[1:5]]}",
              flush=True)
    report["decode_attention"] = results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="attention,linear")
    args = parser.parse_args()
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0),
                              "torch": torch.__version__}
    parts = args.parts.split(",")
    if "attention" in parts:
        probe_attention(report)
    if "linear" in parts:
        probe_linear(report)
    if "decode_attention" in parts:
        probe_decode_attention(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
