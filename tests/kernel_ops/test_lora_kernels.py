"""The batched LoRA Triton kernels, run by Triton's interpreter, against the grouped torch
reference (and the reference against a plain per-row loop).

As in test_triton_kernels.py, the interpreted cases run in a child pytest process started
with TRITON_INTERPRET=1 (Triton picks its interpreter when first imported).
"""

from __future__ import annotations

import pytest
import torch
from hopper_compile import compile_launches
from test_triton_kernels import (  # noqa: F401 (an autouse fixture)
    InterpreterRun,
    _interpreter_with_gpu_bf16_numerics,
    in_interpreter,
    outside_interpreter,
)
from triton.runtime import interpreter as triton_interpreter

from meshserve.kernels import triton_lora
from meshserve.kernels.lora import LoraBatch, add_lora_reference, group_rows

INTERPRETED = isinstance(triton_lora._shrink_kernel, triton_interpreter.InterpretedFunction)


def _case(row_slots: list[int], num_slots: int, k: int, slices: tuple[int, ...], rank: int,
          dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = len(row_slots)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(num_slots, len(slices) * rank, k, generator=g) * 0.2).to(dtype)
    b = (torch.randn(num_slots, sum(slices), rank, generator=g) * 0.2).to(dtype)
    y = torch.randn(t, sum(slices), generator=g).to(dtype)
    rows, starts, counts = group_rows(row_slots, num_slots)
    batch = LoraBatch(torch.tensor(rows + [0] * (t - len(rows)), dtype=torch.int32),
                      torch.tensor(starts, dtype=torch.int32),
                      torch.tensor(counts, dtype=torch.int32))
    return x, a, b, y, batch


def test_group_rows() -> None:
    rows, starts, counts = group_rows([2, -1, 0, 2, 0, -1], 3)
    assert (rows, starts, counts) == ([2, 4, 0, 3], [0, 2, 2], [2, 0, 2])


@outside_interpreter
def test_reference_is_a_per_row_lora() -> None:
    slots = [1, -1, 0, 1, 1, -1, 0]
    slices = (24, 8, 8)
    x, a, b, y, batch = _case(slots, 2, 32, slices, 4, torch.float32)
    expected = y.clone()
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        h = x[row] @ a[slot].T  # [n*R]
        offset = 0
        for i, size in enumerate(slices):
            expected[row, offset:offset + size] += b[slot, offset:offset + size] @ h[i * 4:(i + 1) * 4]
            offset += size
    add_lora_reference(y, x, a, b, slices, batch)
    torch.testing.assert_close(y, expected)


CASES = [
    # (row slots, slots, K, output slices, rank, dtype)
    ([0], 1, 64, (32,), 16, torch.float32),  # one decode row
    ([1, -1, 0, 1, 2, 2, -1, 0], 3, 96, (32, 16, 16), 16, torch.float32),  # fused q/k/v
    ([-1, -1, -1], 2, 64, (48,), 16, torch.float32),  # no adapter at all
    ([i % 4 - 1 for i in range(70)], 3, 80, (40, 40), 32, torch.float32),  # several tiles
    ([0, 1, 0, 1, -1], 2, 128, (64, 32, 32), 16, torch.bfloat16),
    ([0, 1, -1, 0], 2, 1100, (32,), 16, torch.float32),  # K split over 3 programs (atomics)
    ([1, 0, -1, 1, 0, 0], 2, 64, (40, 24, 24), 16, torch.float32),  # a launch per slice
    ([2, 0, 1, -1, 2], 3, 64, (128, 64, 64), 16, torch.bfloat16),  # one launch, 64 columns
]


@in_interpreter
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case: int) -> None:
    slots, num_slots, k, slices, rank, dtype = CASES[case]
    x, a, b, y, batch = _case(slots, num_slots, k, slices, rank, dtype, seed=case)
    expected = y.clone()
    add_lora_reference(expected, x, a, b, slices, batch)
    triton_lora.add_lora(y, x, a, b, slices, batch)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), expected.float(), atol=tol, rtol=tol)
    untouched = [r for r, s in enumerate(slots) if s < 0]
    if untouched:  # rows without an adapter keep y exactly
        fresh = _case(slots, num_slots, k, slices, rank, dtype, seed=case)[3]
        assert torch.equal(y[untouched], fresh[untouched])


@outside_interpreter
def test_lora_kernels_under_the_interpreter(interpreter: InterpreterRun) -> None:
    assert interpreter.passes(__file__, "kernel_matches_reference") == len(CASES)


# Compiles both kernels for Hopper (sm_90) as a JIT launch on the 8B shapes would (bf16,
# pointers and row strides divisible by 16), and reports spill bytes. A child process: the
# interpreter may be switched on in this one.
_COMPILE_FOR_HOPPER = r"""
import json
from hopper_compile import build as build_any
from meshserve.kernels import triton_lora as tl_lora

def build(kernel, types, consts, **options):  # pointers alone aligned, as the LoRA launches are
    return build_any(kernel, types, consts, lambda name: name.endswith("_ptr"), **options)

ints = {n: "*i32" for n in ("sorted_ptr", "start_ptr", "count_ptr")}
out = []
for block_m, split_k in ((16, 8), (64, 1), (64, 16)):
    out.append(build(tl_lora._shrink_kernel,
                     {"x_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*fp32", **ints},
                     dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, SPLIT_K=split_k,
                          DOT_PRECISION="tf32"), num_warps=8 if block_m >= 64 else 4))
for block_m in (16, 64):
    out.append(build(tl_lora._expand_kernel,
                     {"h_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", **ints},
                     dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=16, DOT_PRECISION="tf32")))
print(json.dumps(out))
"""


@outside_interpreter
def test_lora_kernels_compile_for_hopper_without_spills() -> None:
    launches = compile_launches(_COMPILE_FOR_HOPPER)
    assert len(launches) == 5
    assert all(launch["spill"] == 0 for launch in launches), launches
