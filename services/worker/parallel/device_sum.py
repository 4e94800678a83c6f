"""The sum over ranks that a tensor-parallel layer makes after its partial product.

A decode step of a 32-layer model makes 64 of them, each of a few kilobytes, so their
latency, not their bandwidth, is what they cost. On GPUs that reach each other's memory
(NVLink), PyTorch's symmetric memory gives a one-shot all-reduce: every rank copies its
part into a buffer that all ranks have mapped, and each reads all the others' and adds.
loadtest/tp_allreduce_probe.py measured it inside CUDA graphs on two H200s: 7.4 us at
8 KB against NCCL's 17.2 us, 14.4 against 24.1 us at 1 MB, and slower than a two-shot
or NCCL's ring from 4 MB on. Larger tensors (prefill), CPUs (gloo) and
`--disable-custom-all-reduce` use `torch.distributed.all_reduce`.

Every such sum in a decoder layer is followed by the residual add and RMSNorm, so the model's
norms ask for all three at once (`add_rms_norm`). On GPUs with symmetric memory a batch of up
to FUSED_MAX_BYTES per sum takes one kernel for it (kernels/triton_rank_sum_norm.py) instead
of a copy, an all-reduce and the norm; everything else sums first and then normalises.
`--no-tp-fused-norm` turns the fused kernel off (to compare).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshserve.kernels.norm import fused_add_rms_norm

log = logging.getLogger(__name__)

# The largest tensor the one-shot all-reduce takes (bytes): past it NCCL is as fast.
ONE_SHOT_MAX_BYTES = 1 << 20
# The largest partial sum (bytes) the fused sum + add + RMSNorm takes: 64 rows of 4096 in
# bf16. Every call site has a region this big per rank in every rank's symmetric buffer
# (64 sites of the 8B model at TP=2: 67 MB a GPU), and at most FUSED_BUFFER_BYTES in all:
# with more sites or ranks, fewer rows per site.
FUSED_MAX_BYTES = 1 << 19
FUSED_BUFFER_BYTES = 1 << 28


class DeviceSum:
    """Sums a tensor over every rank of the default process group, in place."""

    def __init__(self, buffer: torch.Tensor | None = None, group_name: str = "",
                 fused: FusedSumNorm | None = None) -> None:
        self.buffer = buffer  # [ONE_SHOT_MAX_BYTES / itemsize] symmetric, or None: NCCL
        self.group_name = group_name
        self.fused = fused

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, one_shot: bool, *,
               hidden_size: int = 0, sites: int = 0, fused_norm: bool = True) -> DeviceSum:
        """Every rank calls it at the same point (the buffers' rendezvous is collective).

        `sites`: how many norms ask for `add_rms_norm` (numbered 0..sites-1), each with rows
        of `hidden_size`; the fused kernel needs two or more, and `fused_norm`."""
        if not one_shot or device.type != "cuda":
            return cls()
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
            numel = ONE_SHOT_MAX_BYTES // torch.empty((), dtype=dtype).element_size()
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group_name)
        except Exception as exc:  # noqa: BLE001 - any failure leaves NCCL, which always works
            log.warning("the one-shot all-reduce is unavailable (%s: %s); NCCL sums alone",
                        type(exc).__name__, exc)
            return cls()
        log.info("tensor-parallel sums up to %d KB take the one-shot all-reduce",
                 ONE_SHOT_MAX_BYTES >> 10)
        fused = None
        if sites >= 2 and fused_norm:
            fused = FusedSumNorm.create(device, dtype, hidden_size, sites, group_name)
        return cls(buffer, group_name, fused)

    def takes_one_shot(self, x: torch.Tensor) -> bool:
        return (self.buffer is not None and x.dtype == self.buffer.dtype
                and x.numel() <= self.buffer.numel() and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [*] summed over the ranks, in place; returns `x`."""
        if not self.takes_one_shot(x):
            dist.all_reduce(x)
            return x
        assert self.buffer is not None
        staged = self.buffer[: x.numel()].view_as(x)
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        return x

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s + residual), s + residual), `s` the sum over ranks of `x` [T, H] (a
        row-parallel layer's partial output); `site` is the calling norm's number."""
        if self.fused is not None and self.fused.takes(x, residual, weight):
            return self.fused(x, residual, weight, eps, site)
        return fused_add_rms_norm(self(x), residual, weight, eps)


@dataclass
class FusedSumNorm:
    """Symmetric buffers and flags of kernels/triton_rank_sum_norm.py for `sites` norms."""

    buffer: torch.Tensor  # [sites, world, rows_per_site, hidden] symmetric: peers write rows
    flags: torch.Tensor  # [sites * rows_per_site * world] int32 symmetric: peers set them
    epochs: torch.Tensor  # [sites * rows_per_site] int32, this rank's counters
    buffer_ptrs: torch.Tensor  # [world] int64: every rank's buffer as this rank maps it
    flag_ptrs: torch.Tensor  # [world] int64: every rank's flags
    hidden_size: int
    rows_per_site: int
    sites: int
    rank: int
    world_size: int

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, hidden_size: int, sites: int,
               group_name: str) -> FusedSumNorm | None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            world = dist.get_world_size()
            row_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
            rows = min(FUSED_MAX_BYTES, FUSED_BUFFER_BYTES // (sites * world)) // row_bytes
            if rows < 1:
                return None
            buffer = symm_mem.empty(sites * world * rows * hidden_size, dtype=dtype,
                                    device=device)
            # torch types the group as GroupName, a str at run time
            buffers = symm_mem.rendezvous(buffer, group_name)  # type: ignore[arg-type]
            flags = symm_mem.empty(sites * rows * world, dtype=torch.int32, device=device)
            flag_handle = symm_mem.rendezvous(flags, group_name)  # type: ignore[arg-type]
            flags.zero_()
            failure = None
        except Exception as exc:  # noqa: BLE001 - the unfused sums always work
            failure = f"{type(exc).__name__}: {exc}"
        # Every rank takes the fused kernel or none does (one alone would wait forever). The
        # all-reduce also keeps any peer from setting a flag here before it is zeroed.
        agreed = torch.tensor([failure is None], dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if failure is not None or not agreed.item():
            log.warning("the fused sum + RMSNorm is unavailable (%s); sums, then norms",
                        failure or "a peer could not set it up")
            return None
        log.info("tensor-parallel sums of up to %d rows take the fused sum + RMSNorm kernel "
                 "(%d sites, %.1f MB of symmetric memory)", rows, sites,
                 buffer.numel() * buffer.element_size() / 1e6)
        return cls(buffer=buffer, flags=flags,
                   epochs=torch.zeros(sites * rows, dtype=torch.int32, device=device),
                   buffer_ptrs=torch.tensor(buffers.buffer_ptrs, dtype=torch.int64,
                                            device=device),
                   flag_ptrs=torch.tensor(flag_handle.buffer_ptrs, dtype=torch.int64,
                                          device=device),
                   hidden_size=hidden_size, rows_per_site=rows, sites=sites,
                   rank=buffers.rank, world_size=world)

    def takes(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dim() == 2 and 0 < x.shape[0] <= self.rows_per_site
                and x.shape[1] == self.hidden_size and x.dtype == self.buffer.dtype
                and residual.shape == x.shape and residual.dtype == x.dtype
                and weight.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        from meshserve.kernels.triton_rank_sum_norm import sum_add_rms_norm

        assert 0 <= site < self.sites, f"site {site} of {self.sites}"
        return sum_add_rms_norm(
            x, residual, weight, eps, buffer_ptrs=self.buffer_ptrs, flag_ptrs=self.flag_ptrs,
            epochs=self.epochs, site=site, rows_per_site=self.rows_per_site, rank=self.rank,
            world_size=self.world_size)
