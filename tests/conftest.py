"""Shared test setup: no model hub, tests/ importable, tiny model folders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Before anything imports transformers or huggingface_hub: tests never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

_TESTS_DIR = str(Path(__file__).parent)
if _TESTS_DIR not in sys.path:  # helper modules such as tiny_models import by plain name
    sys.path.insert(0, _TESTS_DIR)

pytest_plugins = ["conftest_redis"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries its layer's marker, named after its folder (tests/unit -> unit, ...),
    so that `pytest -m unit` or `-m "not e2e and not gpu"` runs layers apart."""
    from layer_markers import folder_marker

    for item in items:
        marker = folder_marker(item.path)
        if marker is not None:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (weights, configs, tokenizer), built once per session."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 folder (q/k norm), built once per session."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")
