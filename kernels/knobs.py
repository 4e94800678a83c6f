"""The kernels' process-wide settings: chosen once per process from the worker's config.

    knobs.use(config.kernel_knobs)   # the engine, before it builds anything
    knobs.current().pdl              # a launcher, at launch time

Like torch's own backend flags, these are settings of the process, not of one call: every
kernel launched in a process runs under the same ones, and a tensor-parallel follower
applies its own copy of the config. They are the worker options `--pdl` and `--fp8-widen`
(environment MESHSERVE_PDL, MESHSERVE_FP8_WIDEN, read by the config like every other
option; kernels/ itself reads no environment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class KernelKnobs:
    """How kernels launch. `pdl`: programmatic dependent launch mode on Hopper-class GPUs
    (0 off, 1 wait for the kernel before, 2 also let the next be dispatched; kernels/pdl.py).
    `fp8_widen`: how e4m3 values widen to float16 (cvt: the conversion instruction; bits:
    integer instructions, also offered to the FP8 GEMM tuner)."""

    pdl: Literal[0, 1, 2] = 2
    fp8_widen: Literal["cvt", "bits"] = "cvt"

    def __post_init__(self) -> None:
        assert self.pdl in (0, 1, 2), f"pdl must be 0, 1 or 2, got {self.pdl!r}"
        assert self.fp8_widen in ("cvt", "bits"), \
            f"fp8_widen must be cvt or bits, got {self.fp8_widen!r}"


class _Setting:
    """The one process-wide holder of the knobs (set by `use`)."""

    def __init__(self) -> None:
        self.knobs = KernelKnobs()


_setting = _Setting()


def use(knobs: KernelKnobs) -> KernelKnobs:
    """Launch every kernel of this process with `knobs` from now on; the previous ones."""
    previous, _setting.knobs = _setting.knobs, knobs
    return previous


def current() -> KernelKnobs:
    """The knobs kernels launch with now (the defaults until `use` is called)."""
    return _setting.knobs
