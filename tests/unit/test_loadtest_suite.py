"""loadtest/ as a suite: the GPU driver's parts exist and parse, its preamble links every
package of pyproject's package-dir, no old gpu_*.sh is left, and the reports stay small."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
DRIVER = LOADTEST / "gpu.sh"


def driver_parts() -> list[str]:
    """The parts named in the driver's PARTS array (what its usage lists)."""
    match = re.search(r"^PARTS=\(([^)]*)\)", DRIVER.read_text(), re.MULTILINE)
    assert match, "loadtest/gpu.sh has no PARTS=(...) line"
    return match.group(1).split()


def test_every_part_of_the_usage_has_a_body() -> None:
    parts = driver_parts()
    for wanted in ("suite", "mesh", "kv", "lora", "spec", "fp8", "tp", "structured", "tests",
                   "peer"):
        assert wanted in parts, f"part {wanted} missing from loadtest/gpu.sh"
    usage = subprocess.run(["bash", str(DRIVER)], capture_output=True, text=True, cwd=REPO, check=False)
    assert usage.returncode == 2
    for part in parts:
        assert (LOADTEST / "gpu" / f"{part}.sh").is_file(), f"no loadtest/gpu/{part}.sh"
        assert re.search(rf"^  {part}\s", usage.stdout, re.MULTILINE), f"usage does not list {part}"


def test_an_unknown_part_is_refused() -> None:
    run = subprocess.run(["bash", str(DRIVER), "nosuchpart"], capture_output=True, text=True,
                         cwd=REPO, check=False)
    assert run.returncode == 2 and "unknown part: nosuchpart" in run.stderr


@pytest.mark.parametrize("script", sorted(p.relative_to(REPO).as_posix()
                                          for p in LOADTEST.rglob("*.sh")))
def test_shell_file_parses(script: str) -> None:
    run = subprocess.run(["bash", "-n", script], capture_output=True, text=True, cwd=REPO, check=False)
    assert run.returncode == 0, run.stderr


def test_no_gpu_script_left_at_the_top_level() -> None:
    assert sorted(p.name for p in LOADTEST.glob("gpu_*.sh")) == []


def test_parts_do_not_repeat_the_preamble() -> None:
    for body in (LOADTEST / "gpu").rglob("*.sh"):
        if body.name == "env.sh":
            continue
        text = body.read_text()
        # Calling the preamble's functions (gpu_pkgroot for a second tree) is using it;
        # installing wheels, linking folders or setting the package root is repeating it.
        for marker in ("pip install", "ln -s", "PKGROOT=", "gpu_env "):
            assert marker not in text, f"{body.relative_to(REPO)} repeats the preamble"


def test_reports_stay_small() -> None:
    files = [p for p in (LOADTEST / "reports").rglob("*") if p.is_file()]
    big = [f"{p.relative_to(REPO)}: {p.stat().st_size}" for p in files
           if p.stat().st_size > 1_000_000]
    assert not big, f"report files over 1 MB: {big}"
    total = sum(p.stat().st_size for p in files)
    assert total <= 2_000_000, f"loadtest/reports holds {total} bytes (at most 2 MB)"


def test_preamble_links_every_package_dir_entry(tmp_path: Path) -> None:
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    run = subprocess.run(["bash", "-c", f'. loadtest/gpu/env.sh && gpu_pkgroot "{tmp_path}"'],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert run.returncode == 0, run.stderr
    root = tmp_path / "meshserve"
    assert not (root / "__init__.py").exists(), "meshserve stays a namespace package"
    names = [n for n in table if n.startswith("meshserve.")]
    assert names
    for name in names:
        path = tmp_path.joinpath(*name.split("."))
        assert path.is_dir(), f"{name} not importable from the package root"
        assert path.resolve() == (REPO / table[name]).resolve(), f"{name} -> {path.resolve()}"
    for link in root.iterdir():  # nothing linked that pyproject does not name
        assert f"meshserve.{link.name}" in table, link.name
