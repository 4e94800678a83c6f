"""The sum over tensor-parallel ranks, fused with the residual add and RMSNorm after it.

In a tensor-parallel decoder layer o_proj and down_proj leave a partial sum on every rank,
and the next operation is the residual add + RMSNorm of the full sum. Unfused, that is three
kernels per sum (a copy into a buffer the peers can read, an all-reduce, add + RMSNorm) and
two gaps between them, 64 times in a step of a 32-layer model. This kernel does it in one
launch. Each program takes one row:

1. it writes its row of this rank's partial sum into every peer's symmetric buffer (memory
   every rank has mapped: PyTorch's symmetric memory, set up by
   services/worker/parallel/device_sum.py), into the slot that belongs to this rank. Writes
   to a peer are posted: the row travels one way, where reading the peer's copy would wait
   for a round trip;
2. it sets a flag in every peer's memory to this call's epoch (a release store at system
   scope, after a barrier of the program's threads, so the row lands before the flag);
3. it waits until every peer has set its flag in this rank's memory to the same epoch
   (acquire, polling local memory);
4. it reads the peers' rows from its own buffer, adds all ranks' rows in rank order in
   float32 (so every rank gets the same bits), rounds the sum to the activations' dtype as an
   all-reduce's output would be, and then adds the residual and normalises exactly as
   triton_norm's fused kernel.

Every call site (each norm of the model) has a region of the buffers and flags of its own, so
a rank may go on to the next site while a peer still reads this one: a site's region is
written again only at the same site of the next forward pass, and to get there a rank must
pass every other site in between, each of which waits for all the peers (a model needs at
least two sites; the caller checks). CUDA graphs replay fixed arguments, so the epoch is not
an argument: each (site, row) keeps a counter in this rank's memory that the kernel bumps.
Flags are compared for equality, so a counter that wraps around is harmless: a peer's flag is
never more than one epoch ahead (it would have to pass the next site, which waits for us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from meshserve.kernels import pdl
from meshserve.kernels.pdl import pdl_prologue
from meshserve.kernels.triton_norm import _normalise_row, _num_warps


def sum_add_rms_norm(
    x: torch.Tensor,  # [R, H] this rank's partial sum
    residual: torch.Tensor,  # [R, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    buffer_ptrs: torch.Tensor,  # [W] int64: every rank's [sites, W, rows_per_site, H] buffer
    flag_ptrs: torch.Tensor,  # [W] int32 flags of every rank: [sites * rows_per_site, W] each
    epochs: torch.Tensor,  # [sites * rows_per_site] int32, this rank's own counters
    site: int,
    rows_per_site: int,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum + residual), sum + residual) with `sum` the ranks' `x` added up.

    Every rank must call it with the same site and row count at the same point of its
    stream; the buffers hold `rows_per_site` rows of H elements per site and rank."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape, (
        f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be contiguous [R, H]")
    assert x.dtype == residual.dtype == weight.dtype, (
        f"x {x.dtype}, residual {residual.dtype} and weight {weight.dtype} must share a dtype")
    assert 0 < rows <= rows_per_site, f"{rows} rows, at most {rows_per_site} fit a site"
    assert buffer_ptrs.shape == flag_ptrs.shape == (world_size,) and 0 <= rank < world_size
    assert x.device.type == "cuda" or isinstance(_sum_add_rms_norm_kernel, InterpretedFunction), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    _sum_add_rms_norm_kernel[(rows,)](
        x, residual, weight, out, new_residual, buffer_ptrs, flag_ptrs, epochs,
        hidden, eps, rows_per_site, site * world_size * rows_per_site * hidden,
        site * rows_per_site,
        RANK=rank, WORLD=world_size, WORLD_PAD=triton.next_power_of_2(world_size),
        BLOCK_H=triton.next_power_of_2(hidden),
        num_warps=_num_warps(hidden), **pdl.launch_options(x.device))
    return out, new_residual


@triton.jit
def _sum_add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, new_r_ptr, buffer_ptrs, flag_ptrs,
                             epoch_ptr, hidden, eps, rows_per_site, site_offset, site_row0,
                             RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_PAD: tl.constexpr,
                             BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * hidden + cols, mask=mask, other=0.0)
    ranks = tl.arange(0, WORLD_PAD)
    addresses = tl.load(buffer_ptrs + ranks, mask=ranks < WORLD, other=0)
    flag_addresses = tl.load(flag_ptrs + ranks, mask=ranks < WORLD, other=0)
    slot = site_row0 + row  # this (site, row)'s counter and flags
    epoch = tl.load(epoch_ptr + slot) + 1
    # Rank q's row lives at [site, q, row] of every buffer.
    mine = site_offset + (RANK * rows_per_site + row) * hidden
    for q in tl.static_range(WORLD):
        if q != RANK:
            tl.store(_rank_buffer(addresses, q, dtype) + mine + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's part of the row is written before a flag goes out
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer_flags = _rank_buffer(flag_addresses, q, tl.int32)
            tl.atomic_xchg(peer_flags + slot * WORLD + RANK, epoch, sem="release", scope="sys")
    own_flags = _rank_buffer(flag_addresses, RANK, tl.int32)
    for q in tl.static_range(WORLD):
        if q != RANK:
            seen = tl.atomic_add(own_flags + slot * WORLD + q, 0, sem="acquire", scope="sys")
            while seen != epoch:
                seen = tl.atomic_add(own_flags + slot * WORLD + q, 0, sem="acquire",
                                     scope="sys")
    tl.debug_barrier()  # no thread reads a peer's row before the flags were seen
    own = _rank_buffer(addresses, RANK, dtype)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            total += x.to(tl.float32)
        else:
            theirs = site_offset + (q * rows_per_site + row) * hidden
            # .cg: from L2, where the peer's writes land, never from a line L1 kept.
            part = tl.load(own + theirs + cols, mask=mask, other=0.0, cache_modifier=".cg")
            total += part.to(tl.float32)
    tl.store(epoch_ptr + slot, epoch)
    # The sum is rounded to the activations' dtype (an all-reduce's output), then the add is
    # rounded again, as `residual + x` is in PyTorch.
    summed = total.to(dtype)
    h = (r.to(tl.float32) + summed.to(tl.float32)).to(dtype)
    tl.store(new_r_ptr + row * hidden + cols, h, mask=mask)
    _normalise_row(h, w_ptr, out_ptr, row, hidden, eps, BLOCK_H)


@triton.jit
def _rank_buffer(addresses, q: tl.constexpr, dtype: tl.constexpr):
    """Rank q's buffer (or flags) as a pointer, from the [WORLD_PAD] addresses."""
    address = tl.sum(tl.where(tl.arange(0, addresses.shape[0]) == q, addresses, 0), axis=0)
    # Symmetric buffers are allocated 16-byte aligned: saying so lets the accesses be
    # vectorised (the compiler knows nothing of an address read from memory).
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)
