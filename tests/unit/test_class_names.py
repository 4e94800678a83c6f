"""No two public classes of the project share a name: a name says which one it is."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("services", "shared", "kernels", "proto", "compose", "loadtest/bench")


def public_classes(folders: tuple[str, ...], root: Path = ROOT) -> dict[str, list[str]]:
    """Class name -> the modules defining it (names starting with _ are the module's own)."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    found[node.name].append(str(path.relative_to(root)))
    return found


def test_no_two_public_classes_share_a_name() -> None:
    shared = {name: paths for name, paths in public_classes(FOLDERS).items() if len(paths) > 1}
    assert shared == {}


def test_the_check_sees_a_shared_name(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text("class Request:\n    pass\nclass _Own:\n    pass\n")
    assert public_classes(("a", "b"), tmp_path) == {"Request": ["a/m.py", "b/m.py"]}
