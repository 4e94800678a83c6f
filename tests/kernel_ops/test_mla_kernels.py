"""The Triton latent attention kernel (kernels/triton_mla.py), run by Triton's interpreter on
CPU tensors, against the PyTorch reference of kernels/mla.py: decode, fresh prefill, chunked
prefill over a cached prefix and mixed steps of several sequences, cache block sizes apart from
the key tiles, head counts that are not powers of two, latent rows whose rotary part sits in
either half of the slot, split-KV, float32, bfloat16 and an FP8 cache.

As in test_triton_kernels.py, the interpreted cases run in a child pytest process started with
TRITON_INTERPRET=1 (Triton picks its interpreter when first imported).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
from hopper_compile import compile_launches
from latent_steps import LatentStep, make_latent_step
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    CASES,
    InterpreterRun,
    _interpreter_with_gpu_bf16_numerics,
    assert_attention_close,
    in_interpreter,
    outside_interpreter,
)

from meshserve.kernels import triton_mla
from meshserve.kernels.triton_attention import AttentionTiles

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_latent(step: LatentStep, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, float32 reference output)."""
    out = triton_mla.mla_attention(step.query, step.k_cache, step.v_cache, step.meta,
                                   step.scale, step.rank, **kwargs)  # type: ignore[arg-type]
    return out, step.reference()


SHAPES = [  # (heads, kv_lora_rank, rope dims, cache block size)
    (4, 24, 8, 16),  # the tiny test models': pe in the v half, c across both
    (16, 64, 16, 32),  # one token's 16 heads fill a 16-row block
    (6, 32, 32, 16),  # heads padded to 8; c exactly the k half, pe exactly the v half
    (3, 16, 32, 16),  # rank < rope: pe starts in the k half
]


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "rank", "rope", "bs"), SHAPES)
def test_latent_kernel_fp32(case: str, heads: int, rank: int, rope: int, bs: int) -> None:
    ctx_lens, q_lens = CASES[case]
    step = make_latent_step(ctx_lens, q_lens, heads, rank, rope, bs, seed=heads + rank)
    out, want = run_latent(step)
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_latent_kernel_bf16_with_the_served_tiles(case: str) -> None:
    """bfloat16 with the tiles a served model launches (32-row decode, 64-row prefill)."""
    ctx_lens, q_lens = CASES[case]
    step = make_latent_step(ctx_lens, q_lens, 8, 64, 32, 16, dtype=torch.bfloat16, seed=5)
    tiles = triton_mla.default_tiles(torch.bfloat16, torch.bfloat16, step.meta.decode_only)
    assert tiles.block_m >= 32
    out, want = run_latent(step)
    assert out.dtype == torch.bfloat16
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize(("case", "splits"), [
    ("decode-ragged", 3),  # 4 key tiles of the longest sequence, 3 uneven splits
    ("decode-ragged", 8),  # more splits than tiles: some splits are empty
    ("mixed", 2),  # prefill rows split too (a split may see none of a row's keys)
])
def test_split_kv_matches_the_reference(case: str, splits: int) -> None:
    ctx_lens, q_lens = CASES[case]
    step = make_latent_step(ctx_lens, q_lens, 4, 24, 8, 16, seed=splits)
    out, want = run_latent(step, num_splits=splits)
    assert_attention_close(out, want)


@in_interpreter
def test_split_kv_is_chosen_for_a_long_lone_decode() -> None:
    """Two sequences of one head block each leave the SMs idle: 700 keys make two splits,
    merged in chunks (R = 160 is more than one merge chunk)."""
    step = make_latent_step([700, 3], [1, 1], 4, 160, 32, 32, dtype=torch.bfloat16, seed=7)
    out, want = run_latent(step)
    assert_attention_close(out, want)
    assert triton_mla.MERGE_CHUNK < 160


@in_interpreter
def test_small_query_blocks_and_tiles_inside_cache_blocks() -> None:
    """Prefill rows of 2 tokens x 8 heads per program (many blocks per sequence), key tiles
    of 16 inside cache blocks of 64."""
    ctx_lens, q_lens = CASES["chunk-over-prefix"]
    step = make_latent_step(ctx_lens, q_lens, 8, 32, 16, 64, seed=11)
    tiles = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out, want = run_latent(step, tiles=tiles)
    assert_attention_close(out, want)


@in_interpreter
def test_many_short_query_chunks_all_get_programs() -> None:
    ctx_lens = [2, 5, 2, 9, 2, 3, 40, 2, 17, 2]
    step = make_latent_step(ctx_lens, [2] * 10, 4, 24, 8, 16, seed=10)
    out, want = run_latent(step)
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_is_widened(cache_dtype: torch.dtype) -> None:
    ctx_lens, q_lens = CASES["mixed"]
    step = make_latent_step(ctx_lens, q_lens, 4, 24, 8, 16, dtype=torch.bfloat16,
                            cache_dtype=cache_dtype, seed=3)
    out, want = run_latent(step)
    assert_attention_close(out, want)


@in_interpreter
def test_every_latent_variant_is_launched_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's start launches decode and mixed steps and every merge width any split
    count rounds up to, reading the cache only."""
    k_cache, v_cache = (torch.randn(3, 16, 1, 16, generator=torch.Generator().manual_seed(i))
                        for i in (1, 2))
    before = (k_cache.clone(), v_cache.clone())
    seen: list[tuple[bool, int]] = []
    launch = triton_mla.mla_attention

    def record(query, k, v, meta, scale, rank, *, num_splits=None):  # type: ignore[no-untyped-def]
        seen.append((meta.decode_only, num_splits))
        out = launch(query, k, v, meta, scale, rank, num_splits=num_splits)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(triton_mla, "mla_attention", record)
    launches = triton_mla.compile_every_variant(k_cache, v_cache, 4, 24, torch.float32)
    assert launches == len(seen)
    widths = {splits for decode, splits in seen if decode}
    needed = {triton.next_power_of_2(s) for s in range(1, triton_mla.MAX_SPLITS + 1)}
    assert needed <= widths and (False, 1) in seen
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@outside_interpreter
def test_mla_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__) >= 28


_HOPPER_SCRIPT = """
import json
from hopper_compile import build
from meshserve.kernels import triton_mla

launches = []
pointers = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")
# (name, tiles, decode, heads, rank, rope, query dtype, cache dtype)
for name, tiles, decode, heads, rank, rope, dtype, cache in (
        ("decode", triton_mla.MLA_DECODE_TILES, True, 16, 512, 64, "bf16", "bf16"),
        ("decode", triton_mla.MLA_DECODE_TILES, True, 128, 512, 64, "bf16", "bf16"),
        ("prefill", triton_mla.MLA_PREFILL_TILES, False, 16, 512, 64, "bf16", "bf16"),
        ("prefill", triton_mla.MLA_PREFILL_TILES, False, 128, 512, 64, "bf16", "bf16"),
        ("decode-e4m3", triton_mla.MLA_FP8_TILES, True, 128, 512, 64, "bf16", "fp8e4nv"),
        ("prefill-e4m3", triton_mla.MLA_FP8_TILES, False, 16, 512, 64, "bf16", "fp8e4nv"),
        ("prefill-e5m2", triton_mla.MLA_FP8_TILES, False, 16, 512, 64, "fp16", "fp8e5"),
        ("decode-tiny", triton_mla.MLA_DECODE_TILES, True, 4, 24, 8, "bf16", "bf16"),
        ("decode-tiny", triton_mla.MLA_FLOAT32_TILES, True, 4, 24, 8, "fp32", "fp32"),
        ("prefill-tiny", triton_mla.MLA_FLOAT32_TILES, False, 4, 24, 8, "fp32", "fp32")):
    per = min(heads, tiles.block_m)
    block_m = max(per, 16) if decode else tiles.block_m
    consts = dict(NUM_HEADS=heads, RANK=rank, ROPE=rope, HALF=(rank + rope) // 2,
                  RANK_PAD=max(1 << (rank - 1).bit_length(), 16),
                  ROPE_PAD=max(1 << (rope - 1).bit_length(), 16), HEADS=per, BLOCK_SIZE=16, BLOCK_M=block_m,
                  BLOCK_Q=block_m // per, TILE_N=tiles.tile_n, SPLIT=decode,
                  DECODE_ONLY=decode, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    types = {"out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "k_cache_ptr": f"*{cache}",
             "v_cache_ptr": f"*{cache}", "scale_log2": "fp32"}
    types.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr",
                                      "query_start_loc_ptr")})
    types.update({n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")})
    launch = build(triton_mla._mla_kernel, types, consts, num_warps=tiles.num_warps,
                   num_stages=tiles.num_stages)
    launches.append({**launch, "name": f"{name}-{heads}-{dtype}"})
for dtype in ("bf16", "fp32"):
    types = {"out_ptr": f"*{dtype}", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
             "part_sum_ptr": "*fp32"}
    consts = dict(NUM_HEADS=128, RANK=512, CHUNK=triton_mla.MERGE_CHUNK,
                  SPLITS_PAD=triton_mla.MAX_SPLITS)
    launch = build(triton_mla._merge_splits_kernel, types, consts, num_warps=4)
    launches.append({**launch, "name": f"merge-{dtype}"})
print(json.dumps(launches))
"""


@outside_interpreter
def test_latent_kernel_compiles_for_hopper_without_spills() -> None:
    """DeepSeek-V2/V3's shape (R 512, P 64) with 16 and 128 heads in bfloat16, over an FP8
    cache, the tiny test models' shape in float32 and bfloat16, and the split merge, as an
    H100 builds them: no registers spilled, shared memory within the SM's 227 KiB, PDL's wait
    in place."""
    launches = compile_launches(_HOPPER_SCRIPT)
    assert len(launches) == 12
    for launch in launches:
        assert launch["spill"] == 0, launch
        assert launch["shared"] <= 227 * 1024, launch
        assert launch["pdl"], launch
