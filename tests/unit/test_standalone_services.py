"""Services stand alone (decision 10): no service imports another, and the gateway and the
tokenizer run without torch.

The import rule is checked on the source (every import statement of every module of each
service package); the torch rule by importing each service's entry module in a fresh
interpreter, and by loading the default model's tokenizer there the way the tokenizer
service does (a GGUF file, whose metadata transformers reads with torch).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
ROLES = ("gateway", "tokenizer", "scheduler", "worker", "kvstore")


def package_of(path: Path) -> str:
    return "meshserve.services." + ".".join(path.relative_to(SERVICES).parent.parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Every module (or module.name) an import statement of `source` names, relative
    imports resolved against `package`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{module}" if module else base
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("role", ROLES)
def test_a_service_imports_no_other_service(role: str) -> None:
    others = [r for r in ROLES if r != role]
    offenders = []
    for path in sorted((SERVICES / role).rglob("*.py")):
        for name in imported_modules(path.read_text(encoding="utf-8"), package_of(path)):
            parts = name.split(".")
            if parts[:2] == ["meshserve", "services"] and len(parts) > 2 and parts[2] in others:
                offenders.append(f"{path.relative_to(SERVICES)} imports {name}")
            if parts[:2] == ["meshserve", "services"] and len(parts) > 2 and \
                    parts[2] not in ROLES:  # the tools (launcher, bench, offline) are no base
                offenders.append(f"{path.relative_to(SERVICES)} imports {name}")
    assert offenders == []


def test_the_import_check_sees_a_cross_service_import() -> None:
    # The checker itself: a module of one service importing another service is found.
    names = imported_modules("from meshserve.services.worker.engine import engine\n"
                             "from . import wire\n", "meshserve.services.gateway")
    assert "meshserve.services.worker.engine.engine" in names
    assert "meshserve.services.gateway.wire" in names


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("role", ["gateway", "tokenizer"])
def test_text_services_import_without_torch(role: str) -> None:
    done = run_python(
        "import sys\n"
        f"import meshserve.services.{role}.__main__ as main\n"
        "from meshserve.shared.torch_free import forbid_torch\n"
        "forbid_torch()  # what main() does first; fails if torch is already in\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['torch']"  # only the None entry forbid_torch put there


def test_the_default_gguf_tokenizer_loads_without_torch() -> None:
    # The tokenizer service's own loading path, with torch made unimportable first.
    done = run_python(
        "from meshserve.shared.torch_free import forbid_torch\n"
        "forbid_torch()\n"
        "from meshserve.services.tokenizer.__main__ import load_served_model\n"
        "from meshserve.services.tokenizer.config import TokenizerConfig\n"
        "model = load_served_model(TokenizerConfig())\n"
        "ids = model.tokenizer.encode('Hello world', add_special_tokens=False)\n"
        "print(model.tokenizer.vocab_size, model.max_model_len, model.tokenizer.decode(ids))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    vocab, context, text = done.stdout.split(maxsplit=2)
    assert (int(vocab), int(context), text.strip()) == (49152, 8192, "Hello world")
