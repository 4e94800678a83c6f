"""FP8 kernels: quantization and the FP8 linear reference against float64, the FP8 KV cache's
write and read in the attention reference, and the Triton kernels (skinny FP8 product, KV write
and paged attention over an FP8 cache) run by Triton's interpreter against the references.

As in test_triton_kernels.py, the Triton cases run in a child pytest process started with
TRITON_INTERPRET=1 (tests marked `@in_interpreter`); the interpreter handles float8_e4m3fn
tensors natively. Compilation of the FP8 kernels for Hopper (shared memory, no register spills) is checked
without a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hopper_compile import compile_launches
from test_triton_kernels import InterpreterRun
from triton.runtime import interpreter as triton_interpreter

from meshserve.kernels import fp8_widen, knobs, triton_attention, triton_fp8_linear, triton_rotary
from meshserve.kernels.attention import (
    AttentionMetadata,
    decode_attention_reference,
    paged_attention_reference,
    write_kv_reference,
)
from meshserve.kernels.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    fp8_linear,
    fp8_linear_reference,
    quantize_blockwise,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
    scaled_mm,
)
from meshserve.kernels.knobs import KernelKnobs
from meshserve.kernels.rotary import RotaryEmbedding, apply_rotary

INTERPRETED = isinstance(triton_fp8_linear._skinny_fp8_kernel, triton_interpreter.InterpretedFunction)
REPO_ROOT = Path(__file__).resolve().parents[2]
# e4m3: 3 mantissa bits, so rounding to nearest is within 2^-4 of a normal value; below the
# smallest normal (2^-6) the spacing is 2^-9 (absolute, in units of the scale).
REL = 2.0**-4
SUBNORMAL_STEP = 2.0**-9


def in_interpreter(test: Callable[..., None]) -> Callable[..., None] | None:
    return test if INTERPRETED else None


def outside_interpreter(test: Callable[..., None]) -> Callable[..., None] | None:
    return None if INTERPRETED else test


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: per-channel scales matter.
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]


@outside_interpreter
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_quantization_round_trip_is_within_fp8_rounding(scheme: str) -> None:
    w = _weights(48, 80)
    if scheme == "tensor":
        q, scale = quantize_per_tensor(w)
        assert torch.unique(scale).numel() == 1 and scale.shape == (48,)
        full, deq = scale[:, None].double(), dequantize(q, scale, torch.float64)
    elif scheme == "channel":
        q, scale = quantize_per_channel(w)
        full, deq = scale[:, None].double(), dequantize(q, scale, torch.float64)
        # Each row's largest weight lands on the format's largest value.
        assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    else:
        q, scale = quantize_blockwise(w, (32, 32))
        assert scale.shape == (2, 3)  # ceil(48/32) x ceil(80/32)
        full = scale.double().repeat_interleave(32, 0)[:48].repeat_interleave(32, 1)[:, :80]
        deq = dequantize(q, scale, torch.float64, (32, 32))
    assert q.dtype == FP8_DTYPE and not torch.isnan(q.float()).any()
    err = (deq - w.double()).abs()
    assert (err <= REL * w.double().abs() + SUBNORMAL_STEP * full).all()


@outside_interpreter
@pytest.mark.parametrize("quantize_input", [False, True])
def test_fp8_linear_reference_against_float64(quantize_input: bool) -> None:
    w, bias = _weights(40, 96, seed=1), torch.randn(40)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_per_channel(w)
    y = fp8_linear_reference(x, q, scale, bias, quantize_input=quantize_input)
    # Exactly the dequantized weights' product (float32 rounding only) without input rounding.
    x64 = x.double()
    if quantize_input:
        xq, xs = quantize_per_token(x)
        x64 = xq.double() * xs.double()
    exact_deq = x64 @ dequantize(q, scale, torch.float64).T + bias.double()
    assert torch.allclose(y.double(), exact_deq, rtol=1e-5, atol=1e-5)
    # Against the unquantized product: each term's error is bounded by the rounding of w (and
    # of x when quantized).
    exact = x.double() @ w.double().T + bias.double()
    terms = x.double().abs() @ w.double().abs().T
    rel = REL + (REL if quantize_input else 0.0) + REL * REL
    bound = rel * terms + SUBNORMAL_STEP * (x.double().abs() @ scale.double().expand(96, 40)) * 2
    assert ((y.double() - exact).abs() <= bound + 1e-5).all()
    assert (y.double() - exact).abs().max() > 0  # the rounding is really there


@outside_interpreter
@pytest.mark.parametrize("rows", [1, 20, 64])
def test_scaled_mm_operands_give_the_per_token_reference(rows: int) -> None:
    """`scaled_mm` as the GPU calls it (A row-major, B = weight^T column-major, row-wise
    scales), run by torch's CPU `_scaled_mm`, against the reference that rounds x per token."""
    w = _weights(48, 64, seed=3)
    q, scale = quantize_per_channel(w)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = scaled_mm(x, q, scale)
    ref = fp8_linear_reference(x.float(), q, scale, quantize_input=True)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 4e-3  # bf16 output rounding


@outside_interpreter
def test_fp8_linear_on_cpu_is_the_reference_and_keeps_leading_dims() -> None:
    w = _weights(24, 32)
    q, scale = quantize_blockwise(w, (16, 16))
    x = torch.randn(2, 3, 32)
    y = fp8_linear(x, q, scale, block=(16, 16))
    assert y.shape == (2, 3, 24)
    assert torch.equal(y, fp8_linear_reference(x, q, scale, block=(16, 16)))


@outside_interpreter
def test_extremes_neither_overflow_nor_divide_by_zero() -> None:
    q, scale = quantize_per_tensor(torch.tensor([[1e6, -1e6, 0.0, 3.0]]))
    assert torch.equal(q.float()[0, :2], torch.tensor([FP8_MAX, -FP8_MAX]))
    assert torch.equal(dequantize(q, scale, torch.float32)[0, :2], torch.tensor([1e6, -1e6]))
    zero_q, zero_scale = quantize_per_channel(torch.zeros(2, 4))
    assert not torch.isnan(dequantize(zero_q, zero_scale, torch.float32)).any()


def _fp8_step(dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, ...]:
    """A cache of 6 blocks of 4 slots, two sequences' K/V written through write_kv_reference."""
    g = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(6, 4, 2, 16, dtype=dtype)
    v_cache = torch.zeros(6, 4, 2, 16, dtype=dtype)
    key = 3 * torch.randn(10, 2, 16, generator=g)
    value = torch.randn(10, 2, 16, generator=g)
    key[0, 0, 0] = 1000.0  # past e4m3's range: saturates
    slots = torch.tensor([8, 9, 10, 11, 12, 20, 21, 22, -1, 23])
    write_kv_reference(key, value, k_cache, v_cache, slots)
    return key, value, k_cache, v_cache, slots


@outside_interpreter
def test_fp8_cache_write_rounds_saturates_and_skips() -> None:
    key, value, k_cache, v_cache, slots = _fp8_step()
    flat_k = k_cache.float().view(-1, 2, 16)
    ok = slots >= 0
    expected = key[ok].clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    assert torch.equal(flat_k[slots[ok]], expected)
    assert flat_k[8, 0, 0] == FP8_MAX
    assert torch.equal(v_cache.float().view(-1, 2, 16)[slots[ok]],
                       value[ok].to(FP8_DTYPE).float())
    assert flat_k[24:].abs().sum() == 0  # untouched blocks


def _meta(ctx_lens: list[int], q_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1), query_start_loc=torch.tensor(
            starts, dtype=torch.int32), seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens), query_lens_cpu=q_lens, seq_lens_cpu=ctx_lens)


@outside_interpreter
@pytest.mark.parametrize("q_lens", [[1, 1], [2, 3]])
def test_attention_over_an_fp8_cache_equals_attention_over_its_widened_values(
        q_lens: list[int]) -> None:
    _, _, k_cache, v_cache, _ = _fp8_step()
    meta = _meta([5, 4], q_lens, [[2, 3], [5, 0]])
    query = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(9))
    reference = (decode_attention_reference if q_lens == [1, 1] else paged_attention_reference)
    got = reference(query, k_cache, v_cache, meta, 0.25)
    wide = reference(query, k_cache.float(), v_cache.float(), meta, 0.25)
    assert got.dtype == torch.float32 and torch.equal(got, wide)


# ----- Triton, under the interpreter ---------------------------------------------------------

_FP8_TYPES = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}


@pytest.fixture(autouse=True)
def _interpreter_with_gpu_fp8_casts() -> Iterator[None]:
    """Make the interpreter's float -> FP8 casts round as a Hopper GPU does.

    The GPU converts with round-to-nearest-even and saturation (`cvt.rn.satfinite`); the
    interpreter's own conversion neither saturates (1000 -> 256 in e4m3) nor carries a
    rounded-up mantissa into the exponent (1.97 -> 1.0). Cast with torch, saturating.
    """
    if not INTERPRETED:
        yield
        return
    builder = triton_interpreter.InterpreterBuilder
    original_cast = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        fp8 = _FP8_TYPES.get(dst_type.scalar)
        if fp8 is None or src.dtype.scalar not in (tl.float32, tl.float16):
            return original_cast(self, src, dst_type, rounding_mode)
        limit = torch.finfo(fp8).max
        wide = torch.from_numpy(np.asarray(src.data, dtype=np.float32))
        rounded = wide.clamp(-limit, limit).to(fp8).view(torch.uint8).numpy()
        return triton_interpreter.TensorHandle(rounded, dst_type.scalar)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "create_fp_to_fp", create_fp_to_fp)
        yield


@in_interpreter
@pytest.mark.parametrize(("rows", "n", "k", "dtype", "mode", "split_k"), [
    (1, 40, 96, torch.float16, "f16", 1), (1, 16, 70, torch.bfloat16, "f16", 1),
    (5, 33, 64, torch.bfloat16, "f16", 1), (16, 48, 100, torch.float16, "f16", 1),
    (1, 40, 96, torch.bfloat16, "fma", 1), (5, 33, 64, torch.float16, "bf16", 1),
    (1, 40, 96, torch.bfloat16, "f16t", 1), (7, 33, 100, torch.float16, "f16t", 1),
    # K in 3 or 4 chunks of 32 over 2 or 4 splits, the last one shorter; N past the last block.
    (3, 40, 96, torch.bfloat16, "f16", 2), (1, 33, 100, torch.bfloat16, "fma", 4),
    (16, 20, 128, torch.bfloat16, "f16t", 2)])
def test_skinny_fp8_kernel_matches_the_reference(rows: int, n: int, k: int, dtype: torch.dtype,
                                                 mode: str, split_k: int) -> None:
    w = _weights(n, k, seed=rows)
    q, scale = quantize_per_channel(w)
    # Activations over a wide range (1e-3..30): the f16 mode's 2^-8 shift must keep them.
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
         * torch.logspace(-3, 1.5, k)).to(dtype)
    config = dataclasses.replace(triton_fp8_linear.SMALL_CONFIG, mode=mode, split_k=split_k)
    got = triton_fp8_linear.skinny_fp8_linear(x, q, scale, config)
    if split_k > 1:  # every program counted itself and the last one reset the counters
        _, counters = triton_fp8_linear._split_workspaces[(x.device, n, split_k)]
        assert not counters.any()
        again = triton_fp8_linear.skinny_fp8_linear(x, q, scale, config)
        assert torch.equal(again, got)
    ref = fp8_linear_reference(x.float(), q, scale)
    assert got.dtype == dtype
    # The output's own rounding (bf16: 2^-8 relative) bounds the difference.
    tol = 2e-3 if dtype == torch.float16 else 8e-3
    assert torch.allclose(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (
        (got.float() - ref).abs().max())


@triton.jit
def _widen_kernel(x_ptr, y_ptr):
    i = tl.arange(0, 256)
    tl.store(y_ptr + i, fp8_widen.e4m3_to_f16_scaled(tl.load(x_ptr + i), False))


@in_interpreter
def test_widening_e4m3_by_bits_is_the_value_times_2_to_the_minus_8() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every byte
    got = torch.empty(256, dtype=torch.float16)
    _widen_kernel[(1,)](every, got)
    value = every.float()
    finite = ~value.isnan()  # 0x7f and 0xff
    assert int(finite.sum()) == 254
    # Exactly, subnormals (bytes 1..7, 0x81..0x87) and signed zeros included.
    assert torch.equal(got.float()[finite] * 2.0**fp8_widen.SHIFT, value[finite])
    assert torch.equal(got[finite].view(torch.int16) < 0, every.view(torch.uint8)[finite] >= 128)


def _weights_with_extremes(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 weights holding +-448, zeros and subnormals besides random values."""
    q, scale = quantize_per_channel(_weights(n, k, seed=n + k))
    bytes_ = q.view(torch.uint8)
    bytes_[:, :8] = torch.tensor([0x7e, 0xfe, 0x00, 0x80, 0x01, 0x87, 0x08, 0xb3],
                                 dtype=torch.uint8)  # 448, -448, 0, -0, subnormals, 2^-6, ...
    return q, scale


@in_interpreter
@pytest.mark.parametrize(("rows", "n", "k", "dtype", "mode", "split_k"), [
    (1, 40, 96, torch.bfloat16, "fma", 1), (1, 40, 96, torch.bfloat16, "f16", 1),
    (7, 33, 100, torch.float16, "f16t", 1), (3, 40, 96, torch.bfloat16, "f16", 2)])
def test_skinny_fp8_kernel_widening_by_bits_gives_the_same_bits(
        rows: int, n: int, k: int, dtype: torch.dtype, mode: str, split_k: int) -> None:
    q, scale = _weights_with_extremes(n, k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
         * torch.logspace(-3, 1.5, k)).to(dtype)
    config = dataclasses.replace(triton_fp8_linear.SMALL_CONFIG, mode=mode, split_k=split_k)
    cvt = triton_fp8_linear.skinny_fp8_linear(x, q, scale, config)
    bits = triton_fp8_linear.skinny_fp8_linear(
        x, q, scale, dataclasses.replace(config, widen="bits"))
    assert torch.equal(bits, cvt)
    ref = fp8_linear_reference(x.float(), q, scale)
    tol = 2e-3 if dtype == torch.float16 else 8e-3
    assert torch.allclose(bits.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@in_interpreter
@pytest.mark.parametrize(("rows", "k", "dtype"), [(3, 96, torch.float16), (1, 100, torch.float32),
                                                  (4, 64, torch.float16)])
def test_triton_per_token_quantization_equals_the_reference(rows: int, k: int,
                                                            dtype: torch.dtype) -> None:
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 5).to(dtype)
    if rows == 4:
        x[3] = 0  # an all-zero row: the smallest scale, zeros out
    q, scale = triton_fp8_linear.quantize_per_token(x)
    ref_q, ref_scale = quantize_per_token(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (rows, 1)
    assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0)
    # x / scale in float32 may differ in its last bit: at most one FP8 step apart.
    assert torch.allclose(q.float(), ref_q.float(), rtol=2.0**-3, atol=2.0**-9)
    assert (q.float().abs().amax(dim=1)[: 3 if rows == 4 else rows] == FP8_MAX).all()


@in_interpreter
def test_tuning_leaves_aside_a_launch_shape_that_disagrees() -> None:
    from meshserve.kernels import fp8_tuning

    q, scale = quantize_per_channel(_weights(40, 96))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3)).half()
    ref = fp8_linear_reference(x.float(), q, scale)
    config = triton_fp8_linear.SMALL_CONFIG
    assert fp8_tuning._agrees(x, q, scale, config, ref)
    assert not fp8_tuning._agrees(x, q, scale, config, ref * 1.05)
    assert not fp8_tuning._agrees(x, q, scale, config, ref * float("nan"))


@in_interpreter
def test_skinny_fp8_kernel_checks_its_inputs() -> None:
    q, scale = quantize_per_channel(_weights(16, 32))
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        triton_fp8_linear.skinny_fp8_linear(torch.randn(1, 32).half(), q.float().half(), scale)
    with pytest.raises(AssertionError, match="1..16 rows"):
        triton_fp8_linear.skinny_fp8_linear(torch.randn(17, 32).half(), q, scale)
    with pytest.raises(AssertionError, match="scale must be float32"):
        triton_fp8_linear.skinny_fp8_linear(torch.randn(1, 32).half(), q, scale[:8])


@in_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_write_kv_into_fp8_equals_the_reference(cache_dtype: torch.dtype) -> None:
    key, value, ref_k, ref_v, slots = _fp8_step(cache_dtype)
    k_cache = torch.zeros_like(ref_k)
    v_cache = torch.zeros_like(ref_v)
    triton_attention.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.float(), ref_k.float())
    assert torch.equal(v_cache.float(), ref_v.float())


@in_interpreter
@pytest.mark.parametrize("q_lens", [[1, 1], [2, 3]])
def test_triton_attention_over_an_fp8_cache(q_lens: list[int]) -> None:
    _, _, k_cache, v_cache, _ = _fp8_step()
    meta = _meta([5, 4], q_lens, [[2, 3], [5, 0]])
    query = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(9))
    got = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.25)
    ref = paged_attention_reference(query, k_cache.float(), v_cache.float(), meta, 0.25)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@in_interpreter
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2)])
def test_triton_attention_over_an_fp8_cache_with_16_bit_queries(
        q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """16-bit queries over an FP8 cache multiply in float16: results within the output's
    rounding of the float32 reference, and a bf16 query past float16's range stays finite
    (it is scaled by 2^-8 first)."""
    _, _, k_cache, v_cache, _ = _fp8_step(cache_dtype)
    meta = _meta([5, 4], [2, 3], [[2, 3], [5, 0]])
    query = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(9))
    if q_dtype == torch.bfloat16:
        query[1, 2] *= 3e5  # |q| > 65504: overflows float16 unless scaled
    query = query.to(q_dtype)
    previous = knobs.use(KernelKnobs(fp8_widen="cvt"))
    try:
        cvt = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.25)
        knobs.use(KernelKnobs(fp8_widen="bits"))
        got = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.25)
    finally:
        knobs.use(previous)
    ref = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), meta, 0.25)
    assert got.dtype == q_dtype and torch.isfinite(got).all()
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=1e-2), (got.float() - ref).abs().max()
    # e4m3 widened by bits (the values times 2^-8, scaled back exactly): the same bits.
    assert torch.equal(got, cvt)


@in_interpreter
def test_triton_rotary_write_into_fp8_equals_the_reference() -> None:
    g = torch.Generator().manual_seed(4)
    query, key = torch.randn(5, 4, 16, generator=g), 3 * torch.randn(5, 2, 16, generator=g)
    value = torch.randn(5, 2, 16, generator=g)
    positions, slots = torch.tensor([0, 1, 2, 7, 3]), torch.tensor([3, 4, -1, 9, 15])
    rotary = RotaryEmbedding(16, 16, 32, 10000.0)
    rotary.reset_parameters()
    caches = [torch.zeros(4, 4, 2, 16, dtype=FP8_DTYPE) for _ in range(4)]
    q, k = triton_rotary.apply_rotary_and_write_kv(query, key, value, positions,
                                                   rotary.cos_sin_cache, *caches[:2], slots)
    ref_q, ref_k = apply_rotary(query, key, positions, rotary.cos_sin_cache)
    write_kv_reference(ref_k, value, *caches[2:], slots)
    assert torch.allclose(q, ref_q, atol=1e-6) and torch.allclose(k, ref_k, atol=1e-6)
    # A last-bit difference of the rotation may round to the neighbouring FP8 value (one step:
    # 2^-3 relative for e4m3).
    assert torch.allclose(caches[0].float(), caches[2].float(), rtol=2.0**-3, atol=2.0**-9)
    assert torch.equal(caches[1].float(), caches[3].float())


@outside_interpreter
def test_fp8_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__) == 29


_COMPILE_FOR_HOPPER = r"""
import json
from hopper_compile import build
from meshserve.kernels import triton_attention as ta, triton_fp8_linear as tf, triton_rotary as tr

out = []
configs = {tf.fp8_config_for(rows, n, 4096) for rows, n in ((1, 4096), (8, 4096), (8, 28672))}
for c in sorted(configs | set(tf.CANDIDATES), key=str):  # the fallbacks and every candidate
    f16 = c.mode in ("f16", "f16t")
    for one_row in (False, True) if f16 else (False,):  # one-row launches load x's row alone
        out.append(build(tf._skinny_fp8_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv",
            "s_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
            "x_scale": "fp32"}, dict(
            Y_SCALE=2.0**8 if f16 else 1.0, MODE=tf.MODES[c.mode],
            BLOCK_M=1 if c.mode == "fma" else 16, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            EVEN_K=True, SPLIT_K=c.split_k, ONE_ROW=one_row, BITS=c.widen == "bits",
            ASM=c.widen == "bits"), num_warps=c.num_warps,
            num_stages=c.num_stages) | {"config": str(c), "one_row": one_row})
types = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv",
         "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
         "query_start_loc_ptr": "*i32", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
         "part_sum_ptr": "*fp32", "scale_log2": "fp32", "q_scale": "fp32", "v_scale": "fp32",
         "softcap_log2": "fp32", "sinks_ptr": "*bf16", "lookahead_ptr": "*i32"}
for decode in (0, 1):
  for bits in (False, True):
    import torch
    tiles = ta.default_tiles(128, torch.bfloat16, decode)
    out.append(build(ta._paged_attention_kernel, types, dict(GROUP=4, HEAD_DIM=128,
        HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_m // 4,
        TILE_N=tiles.tile_n, SPLIT=bool(decode), DECODE_ONLY=bool(decode), WINDOW=False,
        SOFTCAP=False, SINKS=False, LOOKAHEAD=False,
        DOT_PRECISION="tf32", F16_DOTS=True, BITS=bits, ASM=bits), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages) | {"bits": bits})
out.append(build(tf._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv",
    "s_ptr": "*fp32"}, dict(BLOCK_K=16384), num_warps=8))
out.append(build(ta._write_kv_kernel, {"key_ptr": "*bf16", "value_ptr": "*bf16",
    "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64"},
    dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, HEADS_PAD=8, HEAD_PAD=128), num_warps=4))
bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "v_ptr")}
out.append(build(tr._rotary_kernel, {**bf16, "cache_ptr": "*fp32", "pos_ptr": "*i64",
    "slot_ptr": "*i64", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"},
    dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, REST=0, Q_HEADS_PAD=32,
         KV_HEADS_PAD=8, HALF_PAD=64, REST_PAD=1, HEAD_PAD=128, BLOCK_SIZE=16, WRITE_KV=True),
    num_warps=8, enable_fp_fusion=False))
print(json.dumps(out))
"""


@outside_interpreter
def test_fp8_kernels_compile_for_hopper() -> None:
    launches = compile_launches(_COMPILE_FOR_HOPPER)
    tf = triton_fp8_linear
    configs = {tf.fp8_config_for(rows, n, 4096) for rows, n in ((1, 4096), (8, 4096), (8, 28672))}
    configs |= set(tf.CANDIDATES)  # the fallbacks and every candidate, f16 ones twice
    assert len(launches) == 7 + len(configs) + sum(c.mode in ("f16", "f16t") for c in configs)
    assert all(launch["shared"] <= 227 * 1024 for launch in launches), launches
    assert {launch["kernel"] for launch in launches if not launch["pdl"]} == {
        "_quantize_rows_kernel"}
    # FP8 weights, keys and values are read as vectors, never byte by byte (a mask the
    # compiler cannot align, or a transposed FP8 operand, makes one-byte loads).
    bytewise = [launch for launch in launches
                if launch["byte_shared_loads"] or launch["byte_global_loads"]]
    assert not bytewise, bytewise
    # Widening by bits replaces every FP8 conversion instruction with byte permutes.
    widened = [launch for launch in launches if launch["kernel"] in (
        "_skinny_fp8_kernel", "_paged_attention_kernel")]
    for launch in widened:
        bits = launch.get("bits", "widen='bits'" in launch.get("config", ""))
        assert (launch["fp8_cvt"] == 0) == bits, launch
        assert (launch["prmt"] > 0) or not bits, launch
    assert sum("widen='bits'" in launch.get("config", "") for launch in widened) >= 12
    # A one-row tile may keep a few registers' worth on the stack (L1), never more.
    assert all(launch["spill"] <= (32 if launch.get("one_row") else 0)
               for launch in launches), launches


@outside_interpreter
def test_tuning_offers_one_row_tiles_only_for_one_row_and_falls_back_off_the_gpu() -> None:
    from meshserve.kernels import fp8_tuning

    assert {c.mode for c in fp8_tuning.candidates(1)} == {"fma", "bf16", "f16", "f16t"}
    assert {c.mode for c in fp8_tuning.candidates(5)} == {"bf16", "f16", "f16t"}
    previous = knobs.use(KernelKnobs(fp8_widen="cvt"))
    try:
        assert {c.widen for c in fp8_tuning.candidates(1)} == {"cvt"}
        assert len(fp8_tuning.candidates(5)) < len(triton_fp8_linear.CANDIDATES)
        knobs.use(KernelKnobs(fp8_widen="bits"))  # widening by bits offered too
        assert {c.widen for c in fp8_tuning.candidates(1)} == {"cvt", "bits"}
    finally:
        knobs.use(previous)
    assert all(c.block_k % 16 == 0 and c.block_n >= 4 for c in triton_fp8_linear.CANDIDATES)
    q, scale = quantize_per_channel(_weights(48, 64))
    for rows in (1, 7):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert fp8_tuning.config_for(x, q, scale) == triton_fp8_linear.fp8_config_for(rows, 48, 64)
    assert fp8_tuning.measured == {}  # nothing is timed without a GPU
