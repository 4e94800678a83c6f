"""The worker's device: which one a flag names, and making it current in each thread."""

from __future__ import annotations

import torch

from meshserve.shared.errors import ModelLoadError


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of `name`, made the calling thread's current device; tensor-parallel rank
    r > 0 takes the r-th CUDA device after it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name} asked for, but no CUDA device is available")
    if rank and device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
    make_current(device)
    return device


def make_current(device: torch.device) -> None:
    """Make a CUDA `device` the calling thread's current device (nothing for a CPU).

    Work without an explicit device goes to the current one: Triton launches on the current
    device's stream, CUDA graphs capture on it. A worker given --device cuda:1 would
    otherwise launch on GPU 0, so each thread that runs the model calls this first (the
    current device is per thread)."""
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current one
        torch.cuda.set_device(device)
