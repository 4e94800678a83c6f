"""Which layer a test belongs to, from its folder under tests/: `pytest -m unit` (or
contract, engine, kernels, tokenizer, e2e, gpu) runs one layer; conftest.py applies the
markers, pyproject.toml registers them (`--strict-markers`)."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

# Top-level folder under tests/ -> the marker its tests carry.
FOLDER_MARKERS = {
    "unit": "unit",
    "contract": "contract",
    "engine": "engine",
    "kernel_ops": "kernels",
    "tokenizer": "tokenizer",
    "e2e": "e2e",
    "gpu": "gpu",
}


def folder_marker(path: Path) -> str | None:
    """The marker of the test file at `path`: the one named after its top-level folder under
    tests/; None for a file outside tests/, directly in it, or in an unknown folder."""
    try:
        parts = path.resolve().relative_to(TESTS_DIR).parts
    except ValueError:
        return None
    return FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
