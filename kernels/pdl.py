"""Programmatic dependent launch (PDL) for the Triton kernels of a step, on Hopper and later.

A decode step is a chain of a few hundred short kernels (about 10 per layer), each a few
microseconds long. Normally a kernel's programs are scheduled only once the kernel before it
has finished and its writes are flushed, so the SMs idle between any two kernels while the
last programs drain and the next grid is dispatched. A kernel launched with PDL
(`launch_pdl=True`) may be dispatched while the kernel before it is still running; each of its
programs first executes `griddepcontrol.wait`, which returns once that kernel has completed
and its memory is visible. Nothing an earlier kernel writes is read before the wait, so
results are the same bit for bit; what overlaps is the dispatch and the drain.

Each kernel here takes a `PDL` constexpr and calls `pdl_prologue(PDL)` before it reads
anything an earlier kernel may have written (the skinny products read their first weight
chunk before it: no step writes weights); launch sites splat `launch_options(device)` into
the launch. PDL values:
  0  off (CPUs, the interpreter, GPUs before sm_90, a Triton without GDC, --pdl 0)
  1  wait for the kernel before (--pdl 1)
  2  wait, then let the next kernel be dispatched at once (`griddepcontrol.launch_dependents`),
     so it is already resident when this one ends (the default where PDL works). The next
     kernel is dispatched only once every program of this one runs, so its waiting programs
     never keep this one's from starting.
On an H200 (loadtest/reports/fp8/README.md) single-stream TPOT of the Llama-3.1-8B shape went
from 4.34 to 4.28 (PDL 1) and 4.24 ms (PDL 2) in bf16, from 3.21 to 3.15 and 3.07 ms in FP8,
with logprobs identical bit for bit.
CUDA graphs keep the launch attribute as a programmatic edge, so replayed steps overlap too.
Kernels that PDL does not cover (cuBLAS, copies, NCCL) order as before.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from meshserve.kernels import knobs

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    _HAVE_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


MODES = (0, 1, 2)


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Call first in a kernel launched with `launch_options`: waits for the kernel before
    (PDL >= 1) and, with PDL == 2, lets the kernel after be dispatched."""
    if PDL >= 1:
        gdc_wait()
    if PDL >= 2:
        gdc_launch_dependents()


def requested_mode() -> int:
    """The mode the process's kernel knobs ask for (the worker's --pdl; default 2)."""
    return knobs.current().pdl


@functools.cache
def _launcher_takes_pdl() -> bool:
    """Whether this Triton's CUDA launcher has the `launch_pdl` option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - no NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _mode_for(device_index: int, requested: int) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1" or not _HAVE_GDC or not _launcher_takes_pdl():
        return 0
    if torch.cuda.get_device_capability(device_index) < (9, 0):
        return 0
    return requested


def mode(device: torch.device) -> int:
    """The PDL mode of kernels launched on `device` (0 on anything but a Hopper-class GPU)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _mode_for(index, requested_mode())


def launch_options(device: torch.device) -> dict[str, object]:
    """Keyword arguments of a launch: the kernel's PDL constexpr, and `launch_pdl` when on."""
    m = mode(device)
    return {"PDL": m, "launch_pdl": True} if m else {"PDL": 0}
