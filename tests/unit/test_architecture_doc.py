"""docs/architecture.md against the source it describes, read with `ast` (nothing imported).

- The `request-path` block: at most 12 files, each present, and one after the other
  connected by real imports or by a gRPC stub and the servicer behind it (`broken_links`).
- The `modules` blocks: exactly one line for every module under services/, shared/,
  kernels/, compose/'s packages and loadtest/bench/, and no line for a module that is gone.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
MAX_PATH_FILES = 12
# Import names -> folders, as pyproject.toml's [tool.setuptools.package-dir] maps them.
PACKAGES = {
    "meshserve.services": "services",
    "meshserve.shared": "shared",
    "meshserve.kernels": "kernels",
    "meshserve.cli": "compose/cli",
    "meshserve.local": "compose/local",
    "meshserve.offline": "compose/offline",
    "meshserve.bench": "loadtest/bench",
}
# Where the module list must be complete; compose/ counts only in its Python packages.
MODULE_ROOTS = ("services", "shared", "kernels", "compose", "loadtest/bench")
LINE = re.compile(r"^(?P<path>\S+\.py) — (?P<what>\S.*)$")


# -- reading the doc ------------------------------------------------------------------------


def fenced_blocks(info: str, text: str | None = None) -> list[list[str]]:
    """The lines of every fenced block of the doc whose info string is `info`."""
    text = DOC.read_text() if text is None else text
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if current is None:
            if line.strip() == f"```{info}":
                current = []
        elif line.strip() == "```":
            blocks.append(current)
            current = None
        else:
            current.append(line)
    assert current is None, f"a ```{info} block of {DOC.name} is not closed"
    return blocks


def request_path() -> list[str]:
    blocks = fenced_blocks("request-path")
    assert len(blocks) == 1, f"{DOC.name} needs exactly one ```request-path block"
    return [line.strip() for line in blocks[0] if line.strip()]


def module_lines() -> list[str]:
    return [line for block in fenced_blocks("modules") for line in block if line.strip()]


# -- reading the source ---------------------------------------------------------------------


def all_modules() -> set[str]:
    """Every module the `modules` blocks must list (repository paths)."""
    found: set[str] = set()
    for root in MODULE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            if path.name == "__init__.py" or "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            if root == "compose" and not (path.parent / "__init__.py").is_file():
                continue  # scripts beside the Dockerfiles, not a package
            found.add(path.relative_to(ROOT).as_posix())
    return found


def module_file(name: str) -> Path | None:
    """The project file of an import name (a module, or a package's __init__.py)."""
    for prefix, folder in PACKAGES.items():
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".").replace(".", "/")
            base = ROOT / folder / rest if rest else ROOT / folder
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py")
            if (base / "__init__.py").is_file():
                return base / "__init__.py"
    return None


def package_name(path: Path) -> str | None:
    """The import name of a project file (None outside the mapped packages)."""
    rel = path.relative_to(ROOT).with_suffix("")
    for prefix, folder in PACKAGES.items():
        parts = Path(folder).parts
        if rel.parts[:len(parts)] == parts:
            rest = [p for p in rel.parts[len(parts):] if p != "__init__"]
            return ".".join([prefix, *rest])
    return None


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@cache
def imports(path: Path) -> frozenset[Path]:
    """The project files `path` imports, at any depth (function bodies, TYPE_CHECKING)."""
    own = package_name(path)
    found: set[Path] = set()
    for node in ast.walk(tree(path)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and own is not None:  # relative: resolved against the package
                base = own.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            target = module_file(name)
            if target is not None and target != path:
                found.add(target)
    return frozenset(found)


def reaches(a: Path, b: Path) -> bool:
    """Whether `a` imports `b` directly or through one module of the project."""
    direct = imports(a)
    return b in direct or any(b in imports(m) for m in direct)


def service_of(path: Path) -> str:
    """The service a file belongs to (its top-level package under services/), else its root."""
    parts = path.relative_to(ROOT).parts
    return parts[1] if parts[0] == "services" and len(parts) > 2 else parts[0]


def service_files(service: str) -> list[Path]:
    return [p for p in (ROOT / "services" / service).rglob("*.py") if "_pb2" not in p.name]


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


@cache
def implemented(path: Path) -> frozenset[str]:
    """gRPC servicers the file implements (`class X(worker_pb2_grpc.WorkerServicer)`)."""
    return frozenset(name for node in ast.walk(tree(path)) if isinstance(node, ast.ClassDef)
                     for base in node.bases
                     if (name := _name(base)) is not None and name.endswith("Servicer"))


@cache
def registered(path: Path) -> frozenset[str]:
    """gRPC servicers the file registers (`add_WorkerServicer_to_server(...)`)."""
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Call) and (name := _name(node.func)) is not None:
            match = re.fullmatch(r"add_(\w+Servicer)_to_server", name)
            if match:
                found.add(match.group(1))
    return frozenset(found)


@cache
def stubs_used(service: str) -> frozenset[str]:
    """The servicers whose stubs the service's modules use (`WorkerStub` -> WorkerServicer)."""
    found = set()
    for path in service_files(service):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Name | ast.Attribute):
                name = _name(node)
                if name is not None and name.endswith("Stub") and name != "Stub":
                    found.add(name.removesuffix("Stub") + "Servicer")
    return frozenset(found)


def servicers_of(service: str) -> frozenset[str]:
    """Every servicer some module of the service implements."""
    return frozenset(s for p in service_files(service) for s in implemented(p))


def serves(path: Path) -> frozenset[str]:
    """The servicers a file stands for: those it implements or registers, and those of the
    modules of its service that import it directly (it is their domain side)."""
    found = set(implemented(path) | registered(path))
    for other in service_files(service_of(path)):
        if other != path and path in imports(other):
            found |= implemented(other)
    return frozenset(found)


def link(files: list[Path], i: int) -> str | None:
    """How files[i - 1] leads to files[i] ("import", "call", "answer"), or None.

    - import: the same service, and the earlier file imports the later one directly or
      through one module of the project;
    - call: the later file's service is entered over gRPC: a service already on the path
      uses the stub of a servicer that the later file implements, registers, or is
      imported by directly;
    - answer: the path comes back to a service it was in (the answer of a call): an earlier
      file of that service imports the later file (directly or through one module), and
      that service uses the stub of a servicer of the earlier file's service.
    """
    a, b = files[i - 1], files[i]
    source, target = service_of(a), service_of(b)
    if source == target:
        return "import" if reaches(a, b) else None
    on_path = {service_of(f) for f in files[:i]}
    if any(serves(b) & stubs_used(s) for s in on_path if (ROOT / "services" / s).is_dir()):
        return "call"
    earlier = [f for f in files[:i] if service_of(f) == target]
    if (earlier and any(reaches(e, b) for e in earlier)
            and stubs_used(target) & servicers_of(source)):
        return "answer"
    return None


def broken_links(paths: list[str]) -> list[str]:
    files = [ROOT / p for p in paths]
    return [f"{paths[i - 1]} -> {paths[i]}" for i in range(1, len(files))
            if link(files, i) is None]


# -- the request path -----------------------------------------------------------------------


def test_the_request_path_lists_at_most_twelve_existing_files() -> None:
    paths = request_path()
    assert 2 <= len(paths) <= MAX_PATH_FILES, f"{len(paths)} files in the request path"
    assert len(set(paths)) == len(paths), "a file is listed twice in the request path"
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"request-path files that do not exist: {missing}"


def test_the_request_path_starts_at_the_chat_completions_handler() -> None:
    first = ROOT / request_path()[0]
    handlers = {node.name for node in ast.walk(tree(first))
                if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef)}
    assert "chat_completions" in handlers, f"{first} does not handle /v1/chat/completions"
    assert first in imports(ROOT / "services/gateway/app.py"), \
        "the gateway's app (which registers the routes) does not import the first file"


def test_the_request_path_is_connected_by_imports_and_grpc() -> None:
    broken = broken_links(request_path())
    assert not broken, f"request-path steps with no import or gRPC link: {broken}"


def test_the_request_path_crosses_every_service_of_the_mesh() -> None:
    services = {service_of(ROOT / p) for p in request_path()}
    assert {"gateway", "tokenizer", "scheduler", "worker"} <= services


@pytest.mark.parametrize(("listed", "unrelated"), [
    ("services/worker/serving/engine_thread.py", "services/worker/pooling/embedder.py"),  # same service
    ("services/worker/serving/session.py", "services/worker/serving/kv_publisher.py"),  # entered over gRPC
    ("services/scheduler/route_session.py", "services/kvstore/store.py"),  # no stub of it
    ("services/gateway/flow/generation.py", "services/gateway/parsers/tool_parsers.py"),
    ("services/tokenizer/session.py", "services/tokenizer/config.py"),
])
def test_the_connection_check_fails_for_an_unrelated_file(listed: str, unrelated: str) -> None:
    paths = request_path()
    assert listed in paths, f"{listed} is no longer in the request path: update this test"
    assert (ROOT / unrelated).is_file(), f"{unrelated} is gone: pick another unrelated file"
    swapped = [unrelated if p == listed else p for p in paths]
    assert broken_links(swapped), f"{unrelated} in place of {listed} still looks connected"


def test_the_table_names_only_request_path_files() -> None:
    text = DOC.read_text()
    rows = [line for line in text.splitlines() if re.match(r"^\|\s*\d+\s*\|", line)]
    assert rows, f"{DOC.name} has no table of hops"
    named = {m for row in rows for m in re.findall(r"(?:services|shared|kernels)/[\w/]+\.py",
                                                   row)}
    assert named <= set(request_path()), \
        f"the table names files outside the request-path block: {sorted(named - set(request_path()))}"
    assert len(named) <= MAX_PATH_FILES


# -- one line per module --------------------------------------------------------------------


def test_every_module_line_has_the_form_path_dash_description() -> None:
    bad = [line for line in module_lines() if not LINE.match(line)]
    assert not bad, f"lines of the modules blocks not of the form `path — what it is`: {bad}"


def test_every_module_has_exactly_one_line() -> None:
    listed = [m.group("path") for line in module_lines() if (m := LINE.match(line))]
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not twice, f"modules listed more than once: {twice}"
    gone = sorted(set(listed) - all_modules())
    assert not gone, f"listed modules that do not exist (moved or removed?): {gone}"
    missing = sorted(all_modules() - set(listed))
    assert not missing, f"modules without a line in {DOC.name}: {missing}"


def test_the_doc_helpers_read_what_they_should() -> None:
    text = "x\n```modules\na.py — one\n\nb.py — two\n```\n```request-path\nc.py\n```\n"
    assert fenced_blocks("modules", text) == [["a.py — one", "", "b.py — two"]]
    assert fenced_blocks("request-path", text) == [["c.py"]]
    assert service_of(ROOT / "services/worker/engine/engine.py") == "worker"
    assert module_file("meshserve.bench.serve.cli") == ROOT / "loadtest/bench/serve/cli.py"
    assert package_name(ROOT / "compose/local/launcher.py") == "meshserve.local.launcher"
