"""Micro-benchmarks of the Triton kernels on one CUDA GPU, in a Llama-3-8B head configuration.

    python -m meshserve.kernels.bench_kernels --out kernels.json [--list]

Paged attention decode (batch x context) and prefill are timed against torch SDPA (which runs
FlashAttention or cuDNN) on the same data laid out contiguously, and their outputs compared;
norm, rotary and SiLU kernels are timed against their PyTorch references. Prints a table and
writes every row, with the device name and versions, as JSON. `--list` prints the cases
without touching a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.kernels.activation import silu_and_mul_reference
from meshserve.kernels.attention import AttentionMetadata
from meshserve.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from meshserve.kernels.rotary import RotaryEmbedding

GIB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BenchConfig:
    """What to run, from the command line."""

    out: Path
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    norm_rows: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    block_size: int
    dtype: str
    max_gib: float
    warmup_ms: int
    rep_ms: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def decode_gib(self, batch: int, context: int) -> float:
        """Peak memory of one decode case: contiguous K/V, their paged copies and a temporary."""
        elems = batch * context * self.num_kv_heads * self.head_dim
        return 5 * elems * self.torch_dtype.itemsize / GIB


@dataclass
class BenchRow:
    """One timed kernel call and, where there is one, its baseline."""

    kernel: str
    case: str
    ms: float
    metric: str  # what `value` measures: GB/s or TFLOP/s
    value: float
    baseline: str | None = None
    baseline_ms: float | None = None
    max_abs_err: float | None = None  # against the baseline's output
    note: str = ""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, bool]:
    """The benchmark config and whether only to list the cases."""
    p = argparse.ArgumentParser(prog="bench_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    p.add_argument("--batches", type=_ints, default=(1, 32, 256))
    p.add_argument("--contexts", type=_ints, default=(1024, 4096, 32768))
    p.add_argument("--prefill-tokens", type=_ints, default=(8192,))
    p.add_argument("--norm-rows", type=_ints, default=(1, 256, 8192))
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--max-gib", type=float, default=40.0,
                   help="skip decode cases needing more GPU memory than this")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    args = p.parse_args(argv)
    if args.num_q_heads % args.num_kv_heads:
        p.error(f"--num-q-heads {args.num_q_heads} must be a multiple of --num-kv-heads "
                f"{args.num_kv_heads}")
    fields = {k: v for k, v in vars(args).items() if k != "list"}
    return BenchConfig(**fields), args.list


def planned_cases(cfg: BenchConfig) -> list[tuple[str, str, bool]]:
    """(kernel, case, runnable within --max-gib) for every case, in run order."""
    cases = [("paged_attention_decode", f"B={b} ctx={c}", cfg.decode_gib(b, c) <= cfg.max_gib)
             for b in cfg.batches for c in cfg.contexts]
    cases += [("paged_attention_prefill", f"tokens={n}", True) for n in cfg.prefill_tokens]
    for kernel in ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul"):
        cases += [(kernel, f"T={t}", True) for t in cfg.norm_rows]
    return cases


def _time(fn: Callable[[], object], cfg: BenchConfig) -> float:
    import triton.testing  # GPU only

    return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms,
                                         return_mode="median"))


def _paged_copy(k: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [B, Hkv, L, D] -> a paged cache [B * L / bs, bs, Hkv, D] in shuffled blocks
    and its block table [B, L / bs] (int32)."""
    batch, num_kv_heads, length, head_dim = k.shape
    blocks_per_seq = length // block_size
    table = torch.randperm(batch * blocks_per_seq, device=k.device).view(batch, blocks_per_seq)
    cache = torch.empty(batch * blocks_per_seq, block_size, num_kv_heads, head_dim,
                        dtype=k.dtype, device=k.device)
    cache[table.reshape(-1)] = k.transpose(1, 2).reshape(-1, block_size, num_kv_heads, head_dim)
    return cache, table.to(torch.int32)


def _meta(q_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    device = table.device
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=device),
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)


def bench_decode(cfg: BenchConfig, batch: int, context: int) -> list[BenchRow]:
    from meshserve.kernels import triton_attention as ta  # GPU only

    hq, hkv, d, dtype = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.torch_dtype
    context = -(-context // cfg.block_size) * cfg.block_size
    k = torch.randn(batch, hkv, context, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    k_cache, table = _paged_copy(k, cfg.block_size)
    v_cache = torch.empty_like(k_cache)
    v_cache[table.reshape(-1).long()] = v.transpose(1, 2).reshape(-1, cfg.block_size, hkv, d)
    meta = _meta([1] * batch, [context] * batch, table)
    scale = d**-0.5
    # The baseline: the G query heads of a KV head as G unmasked query rows of one SDPA call.
    q_groups = q.view(batch, hkv, hq // hkv, d)
    want = F.scaled_dot_product_attention(q_groups, k, v, scale=scale).view(batch, hq, d)
    base_ms = _time(lambda: F.scaled_dot_product_attention(q_groups, k, v, scale=scale), cfg)
    splits = ta.choose_num_splits(batch, hkv, 1, context,
                                  torch.cuda.get_device_properties(0).multi_processor_count)
    kv_bytes = 2 * k.numel() * k.element_size()
    rows = []
    for forced in sorted({splits, 1}, reverse=True):
        call = functools.partial(ta.paged_attention, q, k_cache, v_cache, meta, scale,
                                 num_splits=forced)
        got = call()
        ms = _time(call, cfg)
        note = f"splits={forced}" + (" (heuristic)" if forced == splits else "")
        rows.append(BenchRow("paged_attention_decode", f"B={batch} ctx={context}", ms, "GB/s",
                             kv_bytes / ms / 1e6, "sdpa_contiguous", base_ms,
                             (got.float() - want.float()).abs().max().item(), note))
    return rows


def bench_prefill(cfg: BenchConfig, tokens: int) -> list[BenchRow]:
    from meshserve.kernels import triton_attention as ta  # GPU only

    hq, hkv, d, dtype = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.torch_dtype
    tokens = -(-tokens // cfg.block_size) * cfg.block_size
    q = torch.randn(1, hq, tokens, d, dtype=dtype, device="cuda")
    k = torch.randn(1, hkv, tokens, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    k_cache, table = _paged_copy(k, cfg.block_size)
    v_cache = torch.empty_like(k_cache)
    v_cache[table.reshape(-1).long()] = v.transpose(1, 2).reshape(-1, cfg.block_size, hkv, d)
    meta = _meta([tokens], [tokens], table)
    query = q[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    scale = d**-0.5

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=True)

    want = sdpa()[0].transpose(0, 1)
    got = ta.paged_attention(query, k_cache, v_cache, meta, scale)
    ms = _time(lambda: ta.paged_attention(query, k_cache, v_cache, meta, scale), cfg)
    flops = 2 * hq * d * tokens * tokens  # causal: half of 4 * L^2 * D per head
    return [BenchRow("paged_attention_prefill", f"tokens={tokens}", ms, "TFLOP/s",
                     flops / ms / 1e9, "sdpa_causal_contiguous", _time(sdpa, cfg),
                     (got.float() - want.float()).abs().max().item())]


def bench_pointwise(cfg: BenchConfig, rows: int) -> list[BenchRow]:
    """Norm, fused add + norm, rotary and SiLU-and-mul against their PyTorch references."""
    from meshserve.kernels import (  # GPU only
        triton_activation,
        triton_norm,
        triton_rotary,
    )

    dtype, h, eps = cfg.torch_dtype, cfg.hidden, 1e-5
    x = torch.randn(rows, h, dtype=dtype, device="cuda")
    res = torch.randn_like(x)
    w = torch.randn(h, dtype=dtype, device="cuda")
    q = torch.randn(rows, cfg.num_q_heads, cfg.head_dim, dtype=dtype, device="cuda")
    k = torch.randn(rows, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device="cuda")
    pos = torch.randint(0, 8192, (rows,), device="cuda")
    table = RotaryEmbedding(cfg.head_dim, cfg.head_dim, 8192, 500000.0).to("cuda", dtype)
    gate_up = torch.randn(rows, 2 * cfg.intermediate, dtype=dtype, device="cuda")
    size = dtype.itemsize
    cases: list[tuple[str, Callable[[], object], Callable[[], object], int]] = [
        ("rms_norm", lambda: triton_norm.rms_norm(x, w, eps),
         lambda: rms_norm_reference(x, w, eps), 2 * x.numel() * size),
        ("fused_add_rms_norm", lambda: triton_norm.fused_add_rms_norm(x, res, w, eps),
         lambda: fused_add_rms_norm_reference(x, res, w, eps), 4 * x.numel() * size),
        ("rotary", lambda: triton_rotary.apply_rotary(q, k, pos, table.cos_sin_cache),
         lambda: _rotary_reference(q, k, pos, table.cos_sin_cache),
         2 * (q.numel() + k.numel()) * size),
        ("silu_and_mul", lambda: triton_activation.silu_and_mul(gate_up),
         lambda: silu_and_mul_reference(gate_up), gate_up.numel() * size * 3 // 2),
    ]
    out = []
    for name, fn, ref, nbytes in cases:
        ms = _time(fn, cfg)
        out.append(BenchRow(name, f"T={rows}", ms, "GB/s", nbytes / ms / 1e6, "pytorch",
                            _time(ref, cfg)))
    return out


def _rotary_reference(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor,
                      cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch operations of `rotary.apply_rotary`, which on CUDA now goes to Triton."""
    cos, sin = cache[pos].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def run(cfg: BenchConfig) -> list[BenchRow]:
    """Every planned case on the current CUDA device (skipped ones get a row saying so)."""
    rows: list[BenchRow] = []
    for b in cfg.batches:
        for c in cfg.contexts:
            if cfg.decode_gib(b, c) > cfg.max_gib:
                rows.append(BenchRow("paged_attention_decode", f"B={b} ctx={c}", float("nan"),
                                     "GB/s", float("nan"),
                                     note=f"skipped: needs {cfg.decode_gib(b, c):.1f} GiB"))
                continue
            rows += bench_decode(cfg, b, c)
            torch.cuda.empty_cache()
    for n in cfg.prefill_tokens:
        rows += bench_prefill(cfg, n)
    for t in cfg.norm_rows:
        rows += bench_pointwise(cfg, t)
    return rows


def format_table(rows: list[BenchRow]) -> str:
    header = (f"{'kernel':<24} {'case':<18} {'ms':>9} {'value':>10} {'metric':<8} "
              f"{'base ms':>9} {'speedup':>8} {'max err':>9}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        speedup = f"{'':>8}"
        if r.baseline_ms is not None and not math.isnan(r.ms):
            speedup = f"{r.baseline_ms / r.ms:8.2f}"
        base = f"{r.baseline_ms:9.4f}" if r.baseline_ms is not None else f"{'':>9}"
        err = f"{r.max_abs_err:9.2e}" if r.max_abs_err is not None else f"{'':>9}"
        lines.append(f"{r.kernel:<24} {r.case:<18} {r.ms:9.4f} {r.value:10.1f} {r.metric:<8} "
                     f"{base} {speedup} {err}  {r.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks (or list them with --list); 2 when there is no CUDA device."""
    cfg, list_only = parse_args(argv)
    if list_only:
        for kernel, case, runnable in planned_cases(cfg):
            print(f"{kernel:<24} {case:<18} {'' if runnable else 'skipped (--max-gib)'}")
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device; use --list to see the cases", file=sys.stderr)
        return 2
    import triton  # GPU only

    rows = run(cfg)
    print(format_table(rows))
    report = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "triton": triton.__version__, "dtype": cfg.dtype,
        "heads": {"q": cfg.num_q_heads, "kv": cfg.num_kv_heads, "dim": cfg.head_dim},
        "block_size": cfg.block_size, "results": [asdict(r) for r in rows],
    }
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    # NaN (skipped cases) is written as null so that the file is strict JSON.
    cfg.out.write_text(json.dumps(_nan_to_none(report), indent=2) + "\n")
    return 0


def _nan_to_none(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


if __name__ == "__main__":
    raise SystemExit(main())
