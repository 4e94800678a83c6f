"""docs/decisions.md is the record that code comments cite as "(decision N)": every cited
number has its entry there, and the modules each entry names exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "decisions.md"
_CITATION = re.compile(r"\bdecision (\d+)\b", re.IGNORECASE)
_HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)
_REALISED = re.compile(r"^Realised in: (.+?)(?:\n\n|\Z)", re.MULTILINE | re.DOTALL)


def _citations() -> dict[int, list[str]]:
    """Decision number -> the files citing it (Python and proto sources, tests included)."""
    cited: dict[int, list[str]] = {}
    folders = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")]
    for path in (p for d in folders for p in d.rglob("*") if p.suffix in (".py", ".proto")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for number in _CITATION.findall(text):
            cited.setdefault(int(number), []).append(path.relative_to(ROOT).as_posix())
    return cited


def test_every_cited_decision_has_an_entry() -> None:
    entries = {int(n) for n in _HEADING.findall(DOC.read_text())}
    cited = _citations()
    assert cited, "no '(decision N)' citation found: is the pattern still right?"
    missing = {n: sorted(set(files)) for n, files in cited.items() if n not in entries}
    assert not missing, f"decisions cited in code but absent from docs/decisions.md: {missing}"


def test_entries_are_numbered_in_order() -> None:
    numbers = [int(n) for n in _HEADING.findall(DOC.read_text())]
    assert numbers == list(range(1, len(numbers) + 1))


def test_modules_named_by_each_entry_exist() -> None:
    blocks = _REALISED.findall(DOC.read_text())
    assert len(blocks) == len(_HEADING.findall(DOC.read_text())), "an entry names no module"
    paths = [p for block in blocks for p in re.findall(r"`([^`]+)`", block)]
    absent = [p for p in paths if not (ROOT / p).exists()]
    assert not absent, f"docs/decisions.md names paths that do not exist: {absent}"
