"""Importing a loadtest/ script in a test, as the module of its file name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

LOADTEST = Path(__file__).resolve().parents[1] / "loadtest"


def load_script(name: str) -> ModuleType:
    """loadtest/<name>.py as module `name` (registered in sys.modules, where dataclasses
    look their module up); loaded once per test process."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, LOADTEST / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no loadtest/{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
