"""The worker's structure, checked on its source: its subpackages import each other without
cycles and the engine core imports no feature; nothing sets an attribute on an engine part
from outside it; code outside the engine asks the engine, not its parts."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "services" / "worker"
PREFIX = "meshserve.services.worker."
# The features plug into the core through its step hooks (engine/hooks.py).
FEATURES = {"spec", "lora", "structured", "tier"}
# The engine core's parts (attribute names by which code holds them).
PARTS = {"engine", "runner", "model_runner", "scheduler", "kv", "pool", "sampler", "graphs",
         "pieces", "validator"}


def subpackages() -> list[str]:
    return sorted(p.parent.name for p in WORKER.glob("*/__init__.py"))


def imported_modules(path: Path) -> Iterator[str]:
    """Every module `path` imports (at any depth: function bodies and TYPE_CHECKING too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:  # `from meshserve.services.worker import heap`
                yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def subpackage_graph() -> dict[str, set[str]]:
    """Subpackage -> the other worker subpackages its modules import."""
    names = set(subpackages())
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        for path in (WORKER / name).rglob("*.py"):
            for module in imported_modules(path):
                if module.startswith(PREFIX):
                    target = module[len(PREFIX):].split(".")[0]
                    if target in names and target != name:
                        graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_worker_has_its_core_and_feature_subpackages() -> None:
    assert {"engine", "models", "parallel", "serving", "pooling"} | FEATURES <= set(subpackages())


def test_no_import_cycle_among_the_worker_subpackages() -> None:
    graph = subpackage_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_engine_core_imports_no_feature_and_no_serving_side() -> None:
    assert subpackage_graph()["engine"] & (FEATURES | {"serving", "pooling"}) == set()


def test_features_do_not_import_the_serving_side() -> None:
    graph = subpackage_graph()
    assert {name: graph[name] & {"serving", "pooling"} for name in FEATURES} == {
        name: set() for name in FEATURES}


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in (ROOT / folder).rglob("*.py")
            if "_pb2" not in p.name]


def attribute_chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None for anything but names and attributes."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def attributes_set_on_parts(path: Path, root: Path = ROOT) -> list[str]:
    """`x.part.attr = ...` or `part.attr = ...`: an attribute set on an engine part by code
    that is not the part itself (its own code writes `self.attr`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            chain = attribute_chain(target) if isinstance(target, ast.Attribute) else None
            if chain and any(name in PARTS for name in chain[:-1]):
                found.append(f"{path.relative_to(root)}:{node.lineno} {'.'.join(chain)}")
    return found


def test_no_attribute_is_set_on_an_engine_part_from_outside_it() -> None:
    found = [hit for path in python_files("services", "compose", "loadtest/bench")
             for hit in attributes_set_on_parts(path)]
    assert found == []


def test_the_attribute_check_sees_injection(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("runner.verifier = v\nself.scheduler.store_gate = g\nself.kv = kv\n"
                      "engine.runner.lora: object = None\n")
    assert [hit.split(" ")[1] for hit in attributes_set_on_parts(sample, tmp_path)] == [
        "runner.verifier", "self.scheduler.store_gate", "engine.runner.lora"]


@pytest.mark.parametrize("part", ["kv", "runner", "scheduler"])
def test_code_outside_the_engine_asks_the_engine_not_its_parts(part: str) -> None:
    engine_dir = WORKER / "engine"
    found = []
    for path in python_files("services", "compose", "loadtest/bench"):
        if path.is_relative_to(engine_dir) or path == WORKER / "builder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == part:
                chain = attribute_chain(node.value)
                if chain and chain[-1] == "engine":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
