"""Figures of a GPU test, kept as JSON for the driver's reports (loadtest/gpu.sh)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(name: str, figures: object) -> None:
    """`figures` as $GPU_TEST_OUT/<name>.json; nothing when GPU_TEST_OUT is unset."""
    out = os.environ.get("GPU_TEST_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=2, default=str))
