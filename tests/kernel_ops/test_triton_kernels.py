"""The Triton kernels, run by Triton's interpreter on CPU tensors, against the PyTorch references.

Triton chooses its interpreter when `triton` is first imported, and by the time this module is
collected a pytest session has usually imported it already (transformers does). So the kernel
tests run in a child pytest process started with TRITON_INTERPRET=1: tests marked
`@in_interpreter` are collected only there, and `test_kernels_under_the_interpreter` runs them
from the parent session (in one child with the other files' interpreter tests: InterpreterRun,
through conftest.py's `interpreter` fixture).
`TRITON_INTERPRET=1 pytest tests/kernel_ops/test_triton_kernels.py` runs them directly. Shapes
are small because the interpreter runs every program in Python; compilation for Hopper is
checked here too, speed by `meshserve.kernels.bench_kernels`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hopper_compile import compile_launches
from triton.language import standard as tl_standard
from triton.runtime import interpreter as triton_interpreter

from meshserve.kernels import (
    bench_kernels,
    triton_activation,
    triton_attention,
    triton_linear,
    triton_norm,
    triton_rank_sum_norm,
    triton_rotary,
    triton_sampling,
)
from meshserve.kernels.activation import silu_and_mul_reference
from meshserve.kernels.attention import (
    AttentionMetadata,
    paged_attention_reference,
    write_kv_reference,
)
from meshserve.kernels.norm import (
    fused_add_rms_norm_reference,
    rms_norm_f32_weight_reference,
    rms_norm_reference,
)
from meshserve.kernels.rotary import RotaryEmbedding, apply_rotary
from meshserve.kernels.triton_attention import AttentionTiles
from meshserve.services.worker.engine.sampler import Sampler, SamplingRow, make_generator
from meshserve.shared.sampling_params import SamplingParams

# True in the child process: Triton's own library and our kernels are interpreted.
INTERPRETED = all(isinstance(f, triton_interpreter.InterpretedFunction) for f in (
    tl_standard.sum, triton_attention._paged_attention_kernel, triton_norm._rms_norm_kernel,
    triton_rotary._rotary_kernel, triton_activation._silu_and_mul_kernel))
REPO_ROOT = Path(__file__).resolve().parents[2]


def in_interpreter(test: Callable[..., None]) -> Callable[..., None] | None:
    """Collect `test` only where the kernels run in Triton's interpreter."""
    return test if INTERPRETED else None


def outside_interpreter(test: Callable[..., None]) -> Callable[..., None] | None:
    """Collect `test` only in the parent session (it launches no kernel)."""
    return None if INTERPRETED else test


# What a child's junit report holds in a test case that did not pass.
OUTCOMES_NOT_PASSED = ("failure", "error", "skipped")
TIMEOUT_PER_FILE_S = 900  # a hang guard, the slowest file's (test_mla_kernels.py)


class InterpreterRun:
    """The child pytest over `files`, run on the first `passes`; its junit report in
    `report`."""

    def __init__(self, files: list[Path], report: Path) -> None:
        self.files = files
        self.report = report
        self._cases: dict[Path, list[ElementTree.Element]] | None = None

    def passes(self, test_file: str, named: str = "") -> int:
        """How many of `test_file`'s @in_interpreter tests whose names hold `named` passed in
        the child; none of the file's tests there may fail, error or be skipped."""
        path = Path(test_file).resolve()
        assert path in self.files, f"{path.name}'s parent test was not selected"
        cases = self._run()[path]
        bad = [(case.get("name"), [(c.tag, c.get("message", "")[:2000]) for c in case
                                   if c.tag in OUTCOMES_NOT_PASSED])
               for case in cases if any(c.tag in OUTCOMES_NOT_PASSED for c in case)]
        assert not bad, bad
        return sum(named in case.get("name", "") for case in cases)

    def _run(self) -> dict[Path, list[ElementTree.Element]]:
        if self._cases is None:
            env = dict(os.environ, TRITON_INTERPRET="1")
            # The parent waits meanwhile: the child's cases spread over the cores
            # (pytest-xdist; 71 s on one of CI's two cores, 44 s on both).
            workers = min(4, os.cpu_count() or 1) if importlib.util.find_spec("xdist") else 1
            done = subprocess.run(
                [sys.executable, "-m", "pytest", *map(str, self.files), "-q",
                 "-p", "no:cacheprovider", f"--junitxml={self.report}",
                 *(["-n", str(workers)] if workers > 1 else [])],
                cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                timeout=TIMEOUT_PER_FILE_S * len(self.files), check=False)
            # 1: some test failed (its file's parent says which); else the run itself broke.
            assert done.returncode in (0, 1), done.stdout[-8000:] + done.stderr[-2000:]
            self._cases = self._by_file()
        return self._cases

    def _by_file(self) -> dict[Path, list[ElementTree.Element]]:
        """The report's test cases by file (a case's classname is its module's dotted path
        from the repository root, then any class)."""
        cases: dict[Path, list[ElementTree.Element]] = {path: [] for path in self.files}
        modules = {".".join(path.relative_to(REPO_ROOT).with_suffix("").parts): path
                   for path in self.files}
        for case in ElementTree.parse(self.report).getroot().iter("testcase"):
            classname = case.get("classname", "")
            owner = [path for module, path in modules.items()
                     if classname == module or classname.startswith(module + ".")]
            assert len(owner) == 1, f"no one file holds {classname}::{case.get('name')}"
            cases[owner[0]].append(case)
        return cases


@outside_interpreter
def test_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__) > 50  # over fifty kernel cases


# Norm-relative error bounds of half-precision attention against a float32 reference.
REL_ERR = {torch.float16: 1e-3, torch.bfloat16: 5e-3}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_with_gpu_bf16_numerics() -> Iterator[None]:
    """Make two bfloat16 operations of Triton's interpreter behave as on a GPU.

    The interpreter multiplies bfloat16 tl.dot operands as their raw uint16 storage (widen
    them to float32 first: exact, as a bf16 MMA with a float32 accumulator), and it truncates
    float32 -> bfloat16 casts where the GPU rounds to nearest even (round with torch).
    """
    if not INTERPRETED:
        yield
        return
    builder = triton_interpreter.InterpreterBuilder
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore
        if a.dtype.scalar == tl.bfloat16:
            a = original_cast(self, a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = original_cast(self, b, tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):  # type: ignore
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.array(src.data, dtype=np.float32)).bfloat16()
            return triton_interpreter.TensorHandle(
                rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "create_dot", create_dot)
        patch.setattr(builder, "cast_impl", cast_impl)
        yield


@dataclass
class Step:
    query: torch.Tensor  # [T, Hq, D], a strided view of a packed qkv row as in the model
    key: torch.Tensor  # [T, Hkv, D], this step's new keys (not yet in the cache)
    value: torch.Tensor  # [T, Hkv, D], strided view
    k_cache: torch.Tensor  # [N, bs, Hkv, D], random everywhere, prefixes in place
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_step(ctx_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int, bs: int,
              dtype: torch.dtype = torch.float32, seed: int = 0) -> Step:
    """Random sequences whose first ctx - q tokens are cached in shuffled, non-contiguous
    blocks (block tables padded with 0); unused cache blocks hold random junk."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for c in ctx_lens) * 2 + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx_lens]
    slots = []
    for table, ctx, ql in zip(tables, ctx_lens, q_lens):
        slots.extend(table[p // bs] * bs + p % bs for p in range(ctx - ql, ctx))
    num_tokens = sum(q_lens)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    query, key, value = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    width = max(map(len, tables)) + 1
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=starts,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(ctx_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=ctx_lens)
    return Step(query.view(-1, hq, d), key.reshape(-1, hkv, d), value.view(-1, hkv, d),
                k_cache, v_cache, meta)


def run_attention(step: Step, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Write this step's KV with the kernel (checked against the reference write), then
    (kernel output, float32 reference output)."""
    want_k, want_v = step.k_cache.clone(), step.v_cache.clone()
    write_kv_reference(step.key, step.value, want_k, want_v, step.meta.slot_mapping)
    triton_attention.write_kv(step.key, step.value, step.k_cache, step.v_cache,
                              step.meta.slot_mapping)
    assert torch.equal(step.k_cache, want_k) and torch.equal(step.v_cache, want_v)
    scale = step.query.shape[-1] ** -0.5
    out = triton_attention.paged_attention(step.query, step.k_cache, step.v_cache, step.meta,
                                           scale, **kwargs)  # type: ignore[arg-type]
    want = paged_attention_reference(step.query.float(), step.k_cache.float(),
                                     step.v_cache.float(), step.meta, scale)
    return out, want


def assert_attention_close(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.is_contiguous() and out.shape == want.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        return
    rel = (out.float() - want).norm() / want.norm()
    assert rel < REL_ERR[out.dtype], f"{out.dtype} relative error {rel:.2e}"
    torch.testing.assert_close(out.float(), want, atol=5 * REL_ERR[out.dtype], rtol=0.0)


CASES = {  # (context lengths, query lengths)
    "decode-ragged": ([1, 17, 64, 5], [1, 1, 1, 1]),
    "prefill-fresh": ([7, 33], [7, 33]),
    "chunk-over-prefix": ([40, 20], [8, 20]),
    "mixed": ([50, 1, 9, 30], [1, 1, 9, 12]),
}
HEADS = [  # (q heads, kv heads, head_dim, cache block size): GQA ratios 1, 2, 4 and MQA
    (2, 2, 64, 16), (4, 2, 128, 32), (8, 2, 64, 32), (4, 1, 128, 16),
]


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), HEADS)
def test_paged_attention_fp32(case: str, hq: int, hkv: int, d: int, bs: int) -> None:
    """In float32 but with the tiles a bfloat16 model launches (128-row prefill blocks)."""
    ctx_lens, q_lens = CASES[case]
    step = make_step(ctx_lens, q_lens, hq, hkv, d, bs, seed=hq + d)
    tiles = triton_attention.default_tiles(d, torch.bfloat16, step.meta.decode_only)
    out, want = run_attention(step, tiles=tiles)
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize(("case", "hq", "hkv", "d", "splits"), [
    ("decode-ragged", 8, 2, 128, 3),  # 4 key tiles of the longest sequence, 3 uneven splits
    ("decode-ragged", 4, 4, 64, 8),  # more splits than tiles: some splits are empty
    ("mixed", 4, 1, 64, 2),  # the kernel also splits prefill rows
])
def test_split_kv_matches_reference(case: str, hq: int, hkv: int, d: int, splits: int) -> None:
    ctx_lens, q_lens = CASES[case]
    step = make_step(ctx_lens, q_lens, hq, hkv, d, bs=16, seed=splits)
    tiles = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out, want = run_attention(step, num_splits=splits, tiles=tiles)
    assert_attention_close(out, want)


def windowed_reference(step: Step, window: int | None, softcap: float | None) -> torch.Tensor:
    """The float32 reference of a step whose KV the kernel has written (run_attention)."""
    scale = step.query.shape[-1] ** -0.5
    return paged_attention_reference(step.query.float(), step.k_cache.float(),
                                     step.v_cache.float(), step.meta, scale, window=window,
                                     softcap=softcap)


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("window", "softcap", "splits"), [
    (5, None, None), (16, None, None), (None, 0.5, None), (7, 1.0, None), (1, None, None),
    (20, 0.5, 3),  # split-KV over a window: splits start at the window's first tile
])
def test_window_and_softcap_match_reference(case: str, window: int | None,
                                            softcap: float | None, splits: int | None) -> None:
    """Gemma's sliding-window and soft-capped attention; 16-key tiles, so windows start
    mid-tile and whole tiles before the window are skipped."""
    ctx_lens, q_lens = CASES[case]
    step = make_step(ctx_lens, q_lens, 8, 2, 64, bs=16, seed=window or 3)
    tiles = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out, _ = run_attention(step, tiles=tiles, window=window, softcap=softcap, num_splits=splits)
    want = windowed_reference(step, window, softcap)
    assert_attention_close(out, want)
    if window is not None and max(ctx_lens) > window:
        plain, _ = run_attention(step, tiles=tiles)
        assert not torch.allclose(plain, want, atol=1e-3), "the window must change the output"


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_and_softcap_in_half_precision(dtype: torch.dtype) -> None:
    ctx_lens, q_lens = CASES["mixed"]
    step = make_step(ctx_lens, q_lens, 4, 2, 64, bs=16, dtype=dtype, seed=9)
    out, _ = run_attention(step, window=12, softcap=0.5)
    assert_attention_close(out, windowed_reference(step, 12, 0.5))


@in_interpreter
def test_split_kv_is_chosen_for_a_long_lone_decode() -> None:
    step = make_step([700, 3], [1, 1], hq=4, hkv=1, d=64, bs=16, seed=7)
    meta = step.meta
    splits = triton_attention.choose_num_splits(meta.num_seqs, 1, meta.max_query_len,
                                                meta.max_seq_len,
                                                triton_attention.DEFAULT_NUM_SMS)
    assert splits == 700 // triton_attention.MIN_KEYS_PER_SPLIT == 2
    out, want = run_attention(step)
    assert_attention_close(out, want)


@in_interpreter
def test_every_attention_variant_is_launched_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's start launches each compiled variant once: decode and mixed steps, and
    every split-reduction width any split count rounds up to (Triton compiles per width)."""
    k_cache, v_cache = (torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(i))
                        for i in (1, 2))
    before = (k_cache.clone(), v_cache.clone())
    seen: list[tuple[bool, int]] = []
    launch = triton_attention.paged_attention

    def record(query, k, v, meta, scale, *, num_splits=None, tiles=None):  # type: ignore[no-untyped-def]
        seen.append((meta.decode_only, num_splits))
        out = launch(query, k, v, meta, scale, num_splits=num_splits, tiles=tiles)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(triton_attention, "paged_attention", record)
    launches = triton_attention.compile_every_variant(k_cache, v_cache, 4, torch.float32)
    assert launches == len(seen)
    widths = {splits for decode, splits in seen if decode}
    needed = {triton.next_power_of_2(s) for s in range(1, triton_attention.MAX_SPLITS + 1)}
    assert needed <= widths and (False, 1) in seen
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@outside_interpreter
def test_choose_num_splits_heuristic() -> None:
    choose = triton_attention.choose_num_splits
    assert choose(1, 8, 1, 32768, 132) == 33  # ~2 programs per SM
    assert choose(1, 8, 1, 1024, 132) == 4  # at least 256 keys per split
    assert choose(32, 8, 1, 32768, 132) == 1  # 256 programs already fill 132 SMs
    assert choose(1, 8, 16, 32768, 132) == 1  # not a decode step
    assert choose(1, 1, 1, 10**6, 132) == triton_attention.MAX_SPLITS
    assert choose(2, 8, 1, 300, 132) == 1  # too short to split


@in_interpreter
@pytest.mark.parametrize(("case", "bs"), [("prefill-fresh", 32), ("chunk-over-prefix", 16)])
def test_small_query_blocks_span_sequences(case: str, bs: int) -> None:
    """16-row blocks (8 tokens x 2 heads): many query blocks per sequence, keys tiles of 16
    inside blocks of 32."""
    ctx_lens, q_lens = CASES[case]
    step = make_step(ctx_lens, q_lens, hq=4, hkv=2, d=64, bs=bs, seed=3)
    tiles = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out, want = run_attention(step, tiles=tiles)
    assert_attention_close(out, want)


@in_interpreter
def test_many_short_query_chunks_all_get_programs() -> None:
    """Ten 2-token chunks in 8-token query blocks: the grid must reach the last sequence,
    whose first block is numbered 18 // 8 + 9 = 11."""
    ctx_lens = [2, 5, 2, 9, 2, 3, 40, 2, 17, 2]
    step = make_step(ctx_lens, [2] * 10, hq=4, hkv=2, d=64, bs=16, seed=10)
    tiles = AttentionTiles(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out, want = run_attention(step, tiles=tiles)
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize("d", [80, 96, 256])
def test_head_dims_padded_to_a_power_of_two(d: int) -> None:
    ctx_lens, q_lens = CASES["mixed"]
    out, want = run_attention(make_step(ctx_lens, q_lens, hq=6, hkv=2, d=d, bs=16, seed=d))
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_half_precision(dtype: torch.dtype, splits: int) -> None:
    ctx_lens, q_lens = CASES["mixed" if splits == 1 else "decode-ragged"]
    step = make_step(ctx_lens, q_lens, hq=8, hkv=2, d=128, bs=16, dtype=dtype, seed=splits)
    tiles = None if splits == 1 else AttentionTiles(block_m=16, tile_n=16, num_warps=4,
                                                    num_stages=2)
    out, want = run_attention(step, num_splits=splits, tiles=tiles)
    assert out.dtype == dtype
    assert_attention_close(out, want)


@in_interpreter
@pytest.mark.parametrize(("src", "cache", "slot_dtype"), [
    (torch.float32, torch.float32, torch.int64),
    (torch.bfloat16, torch.bfloat16, torch.int32),
    (torch.float32, torch.float16, torch.int64),  # cast to the cache dtype on the way in
])
def test_write_kv_matches_reference(src: torch.dtype, cache: torch.dtype,
                                    slot_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(6, 2, 3, 64, generator=g).to(src)  # [T, k|v, Hkv, D]
    key, value = kv[:, 0], kv[:, 1]  # strided views
    k_cache = torch.randn(5, 4, 3, 64, generator=g).to(cache)
    v_cache = torch.randn(5, 4, 3, 64, generator=g).to(cache)
    slots = torch.tensor([17, -1, 0, 6, -1, 19], dtype=slot_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, want_k, want_v, slots.long())
    triton_attention.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@in_interpreter
def test_launcher_rejects_mismatched_inputs() -> None:
    step = make_step([5], [5], hq=2, hkv=2, d=64, bs=16)
    with pytest.raises(AssertionError, match="k_cache"):
        triton_attention.paged_attention(step.query.half(), step.k_cache, step.v_cache,
                                         step.meta, 0.125)
    with pytest.raises(AssertionError, match="head_dim"):
        triton_attention.paged_attention(step.query[..., :32], step.k_cache, step.v_cache,
                                         step.meta, 0.125)
    with pytest.raises(AssertionError, match="slot_mapping"):
        triton_attention.write_kv(step.key, step.value, step.k_cache, step.v_cache,
                                  step.meta.slot_mapping[:-1])


def _assert_nearly_bitwise(out: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of the sum of squares: float32 within an ulp or so, 16-bit
    outputs (where that ulp rarely changes the rounding) nearly all bit for bit."""
    assert out.dtype == want.dtype and out.shape == want.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        return
    torch.testing.assert_close(out, want)
    assert (out == want).float().mean() > 0.98


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 576)])
def test_rms_norm_matches_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[1], generator=g)).to(dtype)
    out = triton_norm.rms_norm(x, weight, 1e-6)
    _assert_nearly_bitwise(out, rms_norm_reference(x, weight, 1e-6))


@in_interpreter
def test_rms_norm_of_a_strided_head_view_and_a_float32_weight() -> None:
    g = torch.Generator().manual_seed(2)
    packed = torch.randn(3, 4 * 32, generator=g).bfloat16()  # q_norm sees [T, H, D] views
    x = packed[:, 32:96].view(3, 2, 32)
    weight = 1 + 0.5 * torch.randn(32, generator=g)  # float32: the output promotes to it
    out = triton_norm.rms_norm(x, weight, 1e-5)
    _assert_nearly_bitwise(out, rms_norm_reference(x, weight, 1e-5))


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])  # gpt-oss's norm, Gemma's
def test_float32_weight_norms_match_their_reference(dtype: torch.dtype, offset: float) -> None:
    g = torch.Generator().manual_seed(23)
    x = (2 * torch.randn(4, 96, generator=g)).to(dtype)
    residual = (5 * torch.randn(4, 96, generator=g)).to(dtype)
    weight = 0.5 * torch.randn(96, generator=g)  # float32, as gpt-oss keeps it
    want = rms_norm_f32_weight_reference(x, weight, 1e-5, offset)
    _assert_nearly_bitwise(triton_norm.rms_norm_f32_weight(x, weight, 1e-5, offset), want)
    out, new_res = triton_norm.fused_add_rms_norm_f32_weight(x, residual, weight.to(dtype),
                                                            1e-5, offset)
    assert torch.equal(new_res, residual + x)
    _assert_nearly_bitwise(out, rms_norm_f32_weight_reference(residual + x, weight.to(dtype),
                                                              1e-5, offset))


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype, inplace: bool) -> None:
    g = torch.Generator().manual_seed(11)
    x = (2 * torch.randn(4, 96, generator=g)).to(dtype)
    residual = (5 * torch.randn(4, 96, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(96, generator=g)).to(dtype)
    want_out, want_res = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    out, new_res = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-6, inplace=inplace)
    assert torch.equal(new_res, want_res)
    _assert_nearly_bitwise(out, want_out)
    assert (out.data_ptr() == x.data_ptr()) == inplace
    assert (new_res.data_ptr() == residual.data_ptr()) == inplace


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 0)])
def test_rank_sum_norm_sums_the_ranks_then_adds_and_normalises(
        dtype: torch.dtype, world: int, rank: int) -> None:
    """One rank's fused sum + add + RMSNorm with its peers simulated: their rows already
    written into this rank's buffer and their flags set for the call, as their kernels
    would leave them."""
    rows, hidden, sites, rows_per_site, site = 3, 96, 3, 4, 1
    g = torch.Generator().manual_seed(world * 10 + rank)
    residual = (5 * torch.randn(rows, hidden, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
    buffers = [torch.zeros(sites, world, rows_per_site, hidden, dtype=dtype)
               for _ in range(world)]
    flags = [torch.zeros(sites, rows_per_site, world, dtype=torch.int32) for _ in range(world)]
    epochs = torch.zeros(sites, rows_per_site, dtype=torch.int32)

    def addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)

    for call in (1, 2):  # the second call finds the counters at 1 and must wait for 2
        partials = [(2 * torch.randn(rows, hidden, generator=g)).to(dtype)
                    for _ in range(world)]
        for q in range(world):
            if q != rank:
                buffers[rank][site, q, :rows] = partials[q]
                flags[rank][site, :rows, q] = call
        out, new_res = triton_rank_sum_norm.sum_add_rms_norm(
            partials[rank], residual, weight, 1e-6, buffer_ptrs=addresses(buffers),
            flag_ptrs=addresses(flags), epochs=epochs.view(-1), site=site,
            rows_per_site=rows_per_site, rank=rank, world_size=world)
        total = torch.zeros(rows, hidden)
        for part in partials:  # rank order, in float32: what every rank computes
            total += part.float()
        want_out, want_res = fused_add_rms_norm_reference(total.to(dtype), residual, weight,
                                                          1e-6)
        assert torch.equal(new_res, want_res)
        _assert_nearly_bitwise(out, want_out)
        for q in range(world):  # this rank's rows went to each peer, and then its flags
            if q == rank:
                continue
            assert torch.equal(buffers[q][site, rank, :rows], partials[rank])
            assert not buffers[q][site, rank, rows:].any() and not buffers[q][site + 1].any()
            told = flags[q][..., rank]
            assert (told[site, :rows] == call).all()
            assert not told[site, rows:].any() and not told[site + 1].any()
        assert not buffers[rank][:, rank].any()  # its own row stays in registers
        assert (epochs[site, :rows] == call).all()
        assert not epochs[site, rows:].any() and not epochs[0].any()


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "rotary_dim"), [(4, 2, 64, 64), (6, 1, 64, 32)])
def test_rotary_matches_reference_bit_for_bit(dtype: torch.dtype, hq: int, hkv: int,
                                              head_dim: int, rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(hq)
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=512, base=10000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}).to(dtype)
    qkv = (2 * torch.randn(5, (hq + 2 * hkv) * head_dim, generator=g)).to(dtype)
    query = qkv[:, : hq * head_dim].view(5, hq, head_dim)  # strided views, as in the model
    key = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(5, hkv, head_dim)
    positions = torch.tensor([0, 511, 3, 200, 3])
    want_q, want_k = apply_rotary(query, key, positions, rope.cos_sin_cache)  # CPU reference
    got_q, got_k = triton_rotary.apply_rotary(query, key, positions, rope.cos_sin_cache)
    assert got_q.dtype == dtype and got_q.is_contiguous()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@in_interpreter
@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),  # cast to the cache dtype on the way in
])
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "rotary_dim"), [(4, 2, 64, 64), (6, 3, 80, 32)])
def test_rotary_and_write_kv_matches_rotary_then_write(
        dtype: torch.dtype, cache_dtype: torch.dtype, hq: int, hkv: int, head_dim: int,
        rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(hq + head_dim)
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=256, base=10000.0).to(dtype)
    qkv = (2 * torch.randn(6, (hq + 2 * hkv) * head_dim, generator=g)).to(dtype)
    query = qkv[:, : hq * head_dim].view(6, hq, head_dim)  # strided views, as in the model
    key = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(6, hkv, head_dim)
    value = qkv[:, (hq + hkv) * head_dim :].view(6, hkv, head_dim)
    positions = torch.tensor([0, 255, 7, 7, 100, 31])
    slots = torch.tensor([17, -1, 0, 6, 19, 3])  # a padding token (-1) writes nothing
    k_cache = torch.randn(5, 4, hkv, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(5, 4, hkv, head_dim, generator=g).to(cache_dtype)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q, want_k = apply_rotary(query, key, positions, rope.cos_sin_cache)  # CPU reference
    write_kv_reference(want_k, value, want_k_cache, want_v_cache, slots)
    got_q, got_k = triton_rotary.apply_rotary_and_write_kv(
        query, key, value, positions, rope.cos_sin_cache, k_cache, v_cache, slots.int())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    # The CPU method gives the same through the PyTorch references.
    cpu_k_cache, cpu_v_cache = want_k_cache.clone(), want_v_cache.clone()
    cpu_q, cpu_k = rope.rotate_and_write_kv(positions, query, key, value, cpu_k_cache,
                                            cpu_v_cache, slots)
    assert torch.equal(cpu_q, want_q) and torch.equal(cpu_k, want_k)
    assert torch.equal(cpu_k_cache, want_k_cache) and torch.equal(cpu_v_cache, want_v_cache)


@in_interpreter
def test_rotary_and_write_kv_rejects_mismatched_caches() -> None:
    rope = RotaryEmbedding(64, 64, max_position=16, base=10000.0)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    cache = torch.zeros(3, 4, 2, 64)
    with pytest.raises(AssertionError, match="do not match the cache"):
        triton_rotary.apply_rotary_and_write_kv(q, k, k.clone(), torch.tensor([0, 1]),
                                                rope.cos_sin_cache, cache[..., :32],
                                                cache[..., :32], torch.tensor([0, 1]))
    with pytest.raises(AssertionError, match="slot_mapping must be"):
        triton_rotary.apply_rotary_and_write_kv(q, k, k.clone(), torch.tensor([0, 1]),
                                                rope.cos_sin_cache, cache, cache,
                                                torch.tensor([0]))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 1024), (1, 37, 300), (3, 70, 512),
                                              (8, 33, 200), (16, 64, 256)])
def test_skinny_linear_matches_a_float32_product(dtype: torch.dtype, rows: int, n: int,
                                                 k: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, 2 * k, generator=g).to(dtype)[:, :k]  # rows 2k apart
    weight = torch.randn(n, k, generator=g).to(dtype)
    want = x.float() @ weight.float().T
    for config in (triton_linear.SkinnyConfig(16, 64, 4, 2),
                   triton_linear.config_for(rows, n, k)):
        got = triton_linear.skinny_linear(x, weight, config)
        assert got.shape == (rows, n) and got.dtype == dtype
        # float32 accumulation, one rounding to the 16-bit output
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())


@in_interpreter
def test_skinny_linear_rejects_what_it_cannot_do() -> None:
    w = torch.randn(8, 32).half()
    with pytest.raises(AssertionError, match="1..16 rows"):
        triton_linear.skinny_linear(torch.randn(17, 32).half(), w)
    with pytest.raises(AssertionError, match="must both be float16 or bfloat16"):
        triton_linear.skinny_linear(torch.randn(1, 32), w.float())
    with pytest.raises(AssertionError, match="x must be"):
        triton_linear.skinny_linear(torch.randn(1, 31).half(), w)


# chi-square critical value for 5 degrees of freedom at p = 0.001
CHI2_5DOF_P001 = 20.52


@in_interpreter
def test_gumbel_argmax_draws_follow_the_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 1000  # one program per draw, and the interpreter runs each in Python
    seeds = torch.arange(draws, dtype=torch.int64) * 7919 + 12345
    tokens = triton_sampling.gumbel_argmax(logits.expand(draws, -1).contiguous(), seeds)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = logits.softmax(-1).double() * draws
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_5DOF_P001
    # A flat distribution's counts are far from this one's: the test can fail.
    flat = torch.full((6,), draws / 6, dtype=torch.float64)
    assert float(((counts - flat) ** 2 / flat).sum()) > 10 * CHI2_5DOF_P001


@in_interpreter
def test_gumbel_argmax_is_keyed_by_seed_alone() -> None:
    g = torch.Generator().manual_seed(8)
    vocab = 2 * triton_sampling.BLOCK_V + 77  # three chunks, the last one ragged
    logits = torch.randn(5, vocab, generator=g)
    logits[1, :] = float("-inf")
    logits[1, [3, vocab - 1]] = 0.0  # only two tokens can be drawn
    logits[2, 2 * triton_sampling.BLOCK_V + 5] = 60.0  # certain, in the last chunk
    seeds = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64)
    tokens = triton_sampling.gumbel_argmax(logits, seeds)
    assert tokens[1] in (3, vocab - 1) and tokens[2] == 2 * triton_sampling.BLOCK_V + 5
    # The same rows in another order and another batch: the same tokens.
    order = torch.tensor([4, 2, 0])
    again = triton_sampling.gumbel_argmax(logits[order].contiguous(), seeds[order])
    assert torch.equal(again, tokens[order])
    # Other seeds draw differently from a flat row (all equal: 1 in 10^4 per pair).
    flat = torch.zeros(8, vocab)
    drawn = triton_sampling.gumbel_argmax(flat, torch.arange(8, dtype=torch.int64))
    assert len(set(drawn.tolist())) > 4


@in_interpreter
def test_sampler_gpu_draw_keys_seeded_rows_by_position() -> None:
    sampler = Sampler(vocab_size=64, device=torch.device("cpu"), seed=0)
    logits = torch.zeros(3, 64)  # flat: any token may come
    params = SamplingParams(temperature=1.0, seed=5)

    def rows(outputs: list[int], seed: int | None = 5) -> list[SamplingRow]:
        generator = None if seed is None else make_generator(seed, torch.device("cpu"))
        return [SamplingRow(params=params, prompt_token_ids=[1], output_token_ids=outputs,
                            generator=generator)]

    alone = sampler._draw_on_gpu(logits[:1], rows([7, 8]))
    batch = sampler._draw_on_gpu(logits, rows([1], None) + rows([7, 8]) + rows([], None))
    assert int(alone[0]) == int(batch[1])  # same seed, same position: same token
    by_position = [int(sampler._draw_on_gpu(logits[:1], rows([0] * n))[0]) for n in range(12)]
    assert len(set(by_position)) > 3  # each position draws afresh


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(2, 3, 2 * 1500, generator=g)).to(dtype)  # two column blocks per row
    out = triton_activation.silu_and_mul(x)
    want = silu_and_mul_reference(x)
    assert out.shape == (2, 3, 1500)
    _assert_nearly_bitwise(out, want)


@outside_interpreter
def test_bench_lists_its_cases_without_a_gpu(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    cfg, list_only = bench_kernels.parse_args(["--out", str(out), "--batches", "1,256",
                                               "--contexts", "1024,32768", "--max-gib", "40"])
    assert not list_only and cfg.out == out and cfg.torch_dtype == torch.bfloat16
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 8, 128)
    decode = [(case, ok) for kernel, case, ok in bench_kernels.planned_cases(cfg)
              if kernel == "paged_attention_decode"]
    # 256 x 32k x 8 heads x 128 x bf16 is 16 GiB per K or V copy: over the budget.
    assert decode == [("B=1 ctx=1024", True), ("B=1 ctx=32768", True),
                      ("B=256 ctx=1024", True), ("B=256 ctx=32768", False)]
    assert bench_kernels.main(["--out", str(out), "--list"]) == 0
    assert "paged_attention_prefill  tokens=8192" in capsys.readouterr().out
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        assert bench_kernels.main(["--out", str(out)]) == 2
    assert not out.exists()


@outside_interpreter
@pytest.mark.parametrize("argv", [["--batches", "1,x"], ["--contexts", "0"],
                                  ["--num-q-heads", "30"], []])
def test_bench_rejects_bad_arguments(argv: list[str], tmp_path: Path) -> None:
    out = [] if not argv else ["--out", str(tmp_path / "b.json")]
    with pytest.raises(SystemExit) as exc:
        bench_kernels.parse_args(out + argv)
    assert exc.value.code == 2


# Compiles the kernels for Hopper (sm_90) with Triton's bundled ptxas, as a JIT launch would
# (pointers and strides divisible by 16), and prints shared memory and spill bytes per launch.
# It runs in a child process because this one has the interpreter switched on.
_COMPILE_FOR_HOPPER = r"""
import json
import torch
from hopper_compile import build
from meshserve.kernels import (triton_activation, triton_attention as ta, triton_linear,
                               triton_norm, triton_rank_sum_norm, triton_rotary,
                               triton_sampling)

def attention(dtype, name, head_dim, decode, gemma=False, sinks=False, lookahead=False):
    tiles = ta.default_tiles(head_dim, dtype, decode)
    types = {n: "*" + name for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr",
                                     "sinks_ptr")}
    types.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr",
                                      "lookahead_ptr")})
    types.update({n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")})
    types["scale_log2"] = types["q_scale"] = types["v_scale"] = "fp32"
    types["softcap_log2"] = "fp32"
    consts = dict(GROUP=4, HEAD_DIM=head_dim, HEAD_PAD=head_dim, BLOCK_SIZE=16,
                  BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_m // 4, TILE_N=tiles.tile_n,
                  SPLIT=bool(decode), DECODE_ONLY=bool(decode), WINDOW=gemma or sinks,
                  SOFTCAP=gemma, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                  F16_DOTS=False, BITS=False, ASM=False, SINKS=sinks, LOOKAHEAD=lookahead)
    return build(ta._paged_attention_kernel, types, consts, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages)

out = [attention(torch.bfloat16, "bf16", d, decode) for d in (128, 256) for decode in (0, 1)]
out.append(attention(torch.float32, "fp32", 128, 0))
# Gemma 2's layers: a sliding window and soft-capped scores (head_dim 256 as Gemma 2's).
out += [attention(torch.bfloat16, "bf16", 256, decode, gemma=True) for decode in (0, 1)]
# Gemma 3's prefill over images: rows reading ahead, with a window (and soft-capping, which
# Gemma 3 has not: the widest variant); head_dim 256 as Gemma 2's.
out.append(attention(torch.bfloat16, "bf16", 256, 0, gemma=True, lookahead=True))
# gpt-oss's layers: attention sinks and a sliding window (head_dim 64 as gpt-oss's).
out += [attention(torch.bfloat16, "bf16", 64, decode, sinks=True) for decode in (0, 1)]
bf16 = lambda *names: {n: "*bf16" for n in names}
out.append(build(ta._reduce_splits_kernel, bf16("out_ptr") | {n: "*fp32" for n in (
    "part_acc_ptr", "part_max_ptr", "part_sum_ptr")}, dict(NUM_Q_HEADS=32, HEAD_DIM=128,
    HEAD_PAD=128, SPLITS_PAD=8), num_warps=4))
out.append(build(ta._write_kv_kernel, bf16("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")
    | {"slot_ptr": "*i64"}, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, HEADS_PAD=8,
    HEAD_PAD=128), num_warps=4))
out.append(build(triton_norm._fused_add_rms_norm_kernel, bf16("x_ptr", "r_ptr", "w_ptr",
    "out_ptr", "new_r_ptr") | {"eps": "fp32"}, dict(BLOCK_H=8192), num_warps=8))
out.append(build(triton_norm._rms_norm_kernel, bf16("x_ptr", "w_ptr", "out_ptr")
    | {"eps": "fp32"}, dict(BLOCK_H=4096), num_warps=8))
# gpt-oss's norms (hidden 2880, float32 weight) and Gemma's (offset 1).
out.append(build(triton_norm._rms_norm_f32_kernel, bf16("x_ptr", "out_ptr")
    | {"w_ptr": "*fp32", "eps": "fp32", "offset": "fp32"}, dict(BLOCK_H=4096), num_warps=8))
out.append(build(triton_norm._fused_add_rms_norm_f32_kernel, bf16("x_ptr", "r_ptr",
    "out_ptr", "new_r_ptr") | {"w_ptr": "*fp32", "eps": "fp32", "offset": "fp32"},
    dict(BLOCK_H=4096), num_warps=8))
out.append(build(triton_rank_sum_norm._sum_add_rms_norm_kernel, bf16("x_ptr", "r_ptr", "w_ptr",
    "out_ptr", "new_r_ptr") | {"buffer_ptrs": "*i64", "flag_ptrs": "*i64", "epoch_ptr": "*i32",
    "eps": "fp32"}, dict(RANK=1, WORLD=2, WORLD_PAD=2, BLOCK_H=8192), num_warps=8))
for write_kv in (False, True):
    out.append(build(triton_rotary._rotary_kernel, bf16("q_ptr", "k_ptr", "q_out_ptr",
        "k_out_ptr", "cache_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")
        | {"pos_ptr": "*i64", "slot_ptr": "*i64"}, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8,
        HEAD_DIM=128, HALF=64, REST=0, Q_HEADS_PAD=32, KV_HEADS_PAD=8, HALF_PAD=64, REST_PAD=1,
        HEAD_PAD=128, BLOCK_SIZE=16, WRITE_KV=write_kv), num_warps=8, enable_fp_fusion=False))
out.append(build(triton_activation._silu_and_mul_kernel, bf16("x_ptr", "out_ptr"),
    dict(BLOCK=1024), num_warps=4))
out.append(build(triton_sampling._gumbel_argmax_kernel, {"logits_ptr": "*fp32",
    "seeds_ptr": "*i64", "best_ptr": "*fp32", "where_ptr": "*i64"},
    dict(BLOCK=triton_sampling.BLOCK_V), num_warps=8))
for rows, n, k in ((1, 4096, 14336), (1, 128256, 4096), (8, 28672, 4096)):
    c = triton_linear.config_for(rows, n, k)
    out.append(build(triton_linear._skinny_kernel, bf16("x_ptr", "w_ptr", "y_ptr"),
        dict(BLOCK_M=1 if rows == 1 else 16, BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVEN_K=True),
        num_warps=c.num_warps, num_stages=c.num_stages))
print(json.dumps(out))
"""


@outside_interpreter
def test_kernels_compile_for_hopper_without_spills() -> None:
    launches = compile_launches(_COMPILE_FOR_HOPPER)
    assert len(launches) == 24
    # Every kernel of a step but the sampler's waits for the kernel before (PDL on Hopper).
    assert {launch["kernel"] for launch in launches if not launch["pdl"]} == {
        "_gumbel_argmax_kernel"}
    for launch in launches:
        assert launch["shared"] <= 227 * 1024, launch  # Hopper's limit per block
        if launch["consts"].get("DOT_PRECISION") != "ieee":  # float32 may spill: tests only
            assert launch["spill"] == 0, launch
