"""tests/gpu: correctness checks that need a CUDA device (the Triton kernels compiled, the
engine's GPU paths against its CPU path, structured outputs, tensor parallelism). They are
collected everywhere and skipped where torch sees no GPU, so that the CPU CI stays green; on
a GPU machine `bash loadtest/gpu.sh tests` runs them (`pytest -q tests/gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of tests/gpu skipped when no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
                                   "run on a GPU machine: bash loadtest/gpu.sh tests")
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)

