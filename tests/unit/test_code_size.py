"""Size limits on the project's own code: no module over 600 lines, no function or method over
80 (the aim is ~400 and ~60; past these a module or function is split into composed parts).
Generated protobuf code and tests are left out."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("services", "shared", "kernels", "proto", "compose", "loadtest")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _project_files() -> Iterator[Path]:
    for folder in FOLDERS:
        if not (ROOT / folder).is_dir():
            continue
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if "_pb2" in path.name or path.name.startswith("test_") or any(
                    p in (".venv", "__pycache__", "tests") for p in parts):
                continue
            yield path


def _long_functions(tree: ast.AST) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, length) of each function or method over the limit."""
    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        yield f"{prefix}{child.name}", child.lineno, length
            yield from visit(child, name)
    yield from visit(tree, "")


def _offenders() -> tuple[list[str], list[str]]:
    modules, functions = [], []
    for path in _project_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            modules.append(f"{rel}: {lines} lines")
        for name, line, length in _long_functions(ast.parse(text, filename=str(rel))):
            functions.append(f"{rel}:{line} {name}: {length} lines")
    return modules, functions


def test_project_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _project_files()}
    assert "shared/errors.py" in names
    assert not any("_pb2" in n or "/.venv/" in n or n.startswith("tests/") for n in names)


def test_no_module_over_the_limit() -> None:
    modules, _ = _offenders()
    assert not modules, (f"modules over {MAX_MODULE_LINES} lines (split them into composed "
                         "parts):\n  " + "\n  ".join(modules))


def test_no_function_over_the_limit() -> None:
    _, functions = _offenders()
    assert not functions, (f"functions over {MAX_FUNCTION_LINES} lines:\n  "
                           + "\n  ".join(functions))


def test_long_functions_are_measured_with_their_qualified_name() -> None:
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"class A:\n    def short(self):\n        pass\n\n"
                     f"    async def long(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    assert list(_long_functions(tree)) == [("A.long", 5, MAX_FUNCTION_LINES + 1)]
