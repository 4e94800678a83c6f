"""The repository's layout as installed: one import root, nothing that shadows other packages."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_our_kernels_live_under_the_meshserve_root_only() -> None:
    from meshserve.kernels import attention

    assert Path(attention.__file__).resolve().parent == ROOT / "kernels"
    assert importlib.util.find_spec("kernels") is None
    from transformers.utils import import_utils

    assert not import_utils.is_kernels_available()


def test_transformers_does_not_mistake_our_kernels_for_its_optional_package() -> None:
    # Run from the repository root, where a bare `kernels/` folder sits on sys.path[0].
    code = (
        "import meshserve.kernels.attention\n"
        "from transformers.utils import import_utils\n"
        "print(import_utils.is_kernels_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "README must start with a quick start code block"
    commands = [line for line in block.group(1).splitlines()
                if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, f"the quick start has exactly two commands, got {commands}"
    assert "meshserve up" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_every_package_folder_is_installed() -> None:
    # A folder missing from [tool.setuptools] packages imports in an editable install but
    # is absent from a wheel or an image (the compose workers once failed so).
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'^\s+"(meshserve(?:\.\w+)*)",$', text, flags=re.MULTILINE))
    roots = {"services": "meshserve.services", "kernels": "meshserve.kernels",
             "shared": "meshserve.shared", "proto": "meshserve.proto",
             "compose/cli": "meshserve.cli", "compose/local": "meshserve.local",
             "compose/offline": "meshserve.offline", "loadtest/bench": "meshserve.bench"}
    folders = {
        ".".join([roots[root], *init.relative_to(ROOT / root).parts[:-1]])
        for root in roots for init in (ROOT / root).rglob("__init__.py")}
    assert folders, "no package folder found"
    assert folders - listed == set()
