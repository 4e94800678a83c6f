"""Batched LoRA: many adapters in one step, each token with its own adapter (or none).

For a projection y = x @ W^T of a batch of T tokens, the adapter in slot s adds
`(x @ A[s]^T) @ B[s]^T` to the rows of the tokens that use it (the scaling alpha / r is folded
into B when the adapter is loaded). Adapters sit in S static slots: A [S, n*R, K] stacks the
down-projections of the n output slices of a fused projection (q/k/v, gate/up), B [S, N, R]
holds the up-projections of all N output columns; R is the slot rank (the largest rank
allowed, smaller adapters are zero-padded).

Which token uses which slot travels as a `LoraBatch`: the batch's rows grouped by slot
(`sorted_rows`), and where each slot's group starts and how long it is. Its tensors are
static buffers, sized for the largest step, so that CUDA graphs captured once read each
step's grouping: the launch grid depends only on T and S, never on the grouping.

On a GPU the products run as two Triton kernels (`meshserve.kernels.triton_lora`): shrink
(x @ A^T for each slot's rows into a float32 [T, n*R]) and expand (that times B^T, added into
y slice by slice). On a CPU `add_lora_reference` runs the same product with grouped torch
matmuls; it is also what the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of a step use which adapter slot (tensors on the model's device)."""

    sorted_rows: torch.Tensor  # [T_max] int32: row indices of the step, grouped by slot
    slot_start: torch.Tensor  # [S] int32: where slot s's rows start in sorted_rows
    slot_count: torch.Tensor  # [S] int32: how many rows use slot s (0: the slot is idle)

    @property
    def num_slots(self) -> int:
        return self.slot_count.shape[0]


def group_rows(row_slots: Sequence[int], num_slots: int) -> tuple[list[int], list[int],
                                                                   list[int]]:
    """Host-side grouping of a step: per-row slot (-1: no adapter) -> (sorted_rows,
    slot_start, slot_count). Rows without an adapter are left out."""
    groups: list[list[int]] = [[] for _ in range(num_slots)]
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            assert slot < num_slots, f"slot {slot} out of range ({num_slots} slots)"
            groups[slot].append(row)
    sorted_rows: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    for rows in groups:
        starts.append(len(sorted_rows))
        counts.append(len(rows))
        sorted_rows.extend(rows)
    return sorted_rows, starts, counts


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slices: Sequence[int], batch: LoraBatch) -> None:
    """y [T, N] += per-row LoRA of x [T, K], in place.

    a: [S, n*R, K] (slice i's A in rows i*R..(i+1)*R), b: [S, N, R] (slice i's B in the
    output columns of slice i, in order), slices: the n output sizes, summing to N.
    """
    _check(y, x, a, b, slices, batch)
    if x.shape[0] == 0:
        return
    if x.is_cuda:
        from meshserve.kernels import triton_lora  # GPU only

        triton_lora.add_lora(y, x, a, b, slices, batch)
        return
    add_lora_reference(y, x, a, b, slices, batch)


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slices: Sequence[int], batch: LoraBatch) -> None:
    """The grouped torch product: one pair of matmuls per slot that has rows."""
    rank = b.shape[2]
    counts = batch.slot_count.tolist()
    starts = batch.slot_start.tolist()
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        rows = batch.sorted_rows[starts[slot]:starts[slot] + count].long()
        # [c, n*R], rounded to the weights' dtype as a PEFT layer's intermediate is
        h = (x[rows].float() @ a[slot].float().T).to(a.dtype).float()
        parts = []
        offset = 0
        for i, size in enumerate(slices):
            b_i = b[slot, offset:offset + size].float()  # [size, R]
            parts.append(h[:, i * rank:(i + 1) * rank] @ b_i.T)  # [c, size]
            offset += size
        y[rows] += torch.cat(parts, dim=1).to(y.dtype)


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           slices: Sequence[int], batch: LoraBatch) -> None:
    num_tokens, k = x.shape
    s, nr, k_a = a.shape
    assert k_a == k, f"A's input size {k_a} is not x's {k}"
    assert b.shape[0] == s == batch.num_slots, (
        f"A has {s} slots, B {b.shape[0]}, the batch {batch.num_slots}")
    assert nr == len(slices) * b.shape[2], (
        f"A has {nr} rows, expected {len(slices)} slices x rank {b.shape[2]}")
    assert sum(slices) == b.shape[1] == y.shape[1], (
        f"slices {list(slices)} do not cover B's {b.shape[1]} / y's {y.shape[1]} columns")
    assert y.shape[0] == num_tokens, f"y has {y.shape[0]} rows, x {num_tokens}"
    assert batch.sorted_rows.shape[0] >= num_tokens, (
        f"the batch's row buffer ({batch.sorted_rows.shape[0]}) is shorter than the step")
    assert a.dtype == b.dtype == x.dtype, f"dtypes differ: x {x.dtype}, A {a.dtype}, B {b.dtype}"
