"""Every test runs under its layer's marker (`pytest -m unit`, ...): each top-level folder of
tests/ that holds test files has a marker, and each marker is registered in pyproject.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from layer_markers import FOLDER_MARKERS, TESTS_DIR, folder_marker

_PYPROJECT = TESTS_DIR.parent / "pyproject.toml"


def _test_folders() -> list[Path]:
    return sorted(d for d in TESTS_DIR.iterdir()
                  if d.is_dir() and any(d.rglob("test_*.py")))


def test_every_test_folder_has_a_marker() -> None:
    folders = _test_folders()
    assert {d.name for d in folders} >= {"unit", "contract", "engine", "e2e"}
    unmarked = [d.name for d in folders if folder_marker(d / "test_example.py") is None]
    assert not unmarked, f"tests/ folders without a marker in layer_markers.py: {unmarked}"


def test_no_test_file_outside_a_layer_folder() -> None:
    loose = sorted(p.name for p in TESTS_DIR.glob("test_*.py"))
    assert not loose, f"test files directly in tests/ carry no layer marker: {loose}"


def test_markers_follow_the_folder() -> None:
    assert folder_marker(TESTS_DIR / "unit" / "test_x.py") == "unit"
    assert folder_marker(TESTS_DIR / "kernel_ops" / "deep" / "test_x.py") == "kernels"
    assert folder_marker(TESTS_DIR / "gpu" / "test_x.py") == "gpu"
    assert folder_marker(TESTS_DIR / "conftest.py") is None
    assert folder_marker(TESTS_DIR.parent / "services" / "test_x.py") is None


def test_markers_are_registered() -> None:
    ini = tomllib.loads(_PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0].strip() for line in ini["markers"]}
    assert set(FOLDER_MARKERS.values()) <= registered
    assert "--strict-markers" in ini["addopts"].split()


def test_this_test_carries_its_marker(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None
