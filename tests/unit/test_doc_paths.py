"""Every repository file the docs name exists: a module moved or removed takes its docs
with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "loadtest/README.md"]
PATH = re.compile(r"\b((?:services|shared|kernels|compose|loadtest|proto|tests)/[\w/.-]+"
                  r"\.(?:py|sh|md|proto|json|yml|yaml|toml))")


def missing_paths(pages: list[Path], root: Path = ROOT) -> list[str]:
    """`page: path` for every path a page names that is not in the repository."""
    return [f"{page.name}: {match}" for page in pages
            for match in sorted(set(PATH.findall(page.read_text())))
            if not (root / match).exists()]


def test_every_path_the_docs_name_exists() -> None:
    assert missing_paths(PAGES) == []


def test_the_check_sees_a_moved_file(tmp_path: Path) -> None:
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "here.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text("see services/here.py and services/gone.py.")
    assert missing_paths([page], tmp_path) == ["page.md: services/gone.py"]
