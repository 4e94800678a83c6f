"""Setup shared by end-to-end modules of the same configuration (CI time is tight).

test_disagg_stack.py and test_disagg_tcp_stack.py serve the same tiny model and compare
their disaggregated stacks with one mixed worker: a single reference stack answers both
modules' requests, once a session, and is stopped before either disaggregated stack starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import build_tiny_model

Answers = list[dict[str, Any]]


@pytest.fixture(scope="session")
def disagg_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of the disaggregated stacks and of the mixed worker they match."""
    return build_tiny_model(tmp_path_factory.mktemp("disagg-model"), "llama", seed=32,
                            max_position_embeddings=1024)


@pytest.fixture(scope="session")
def mixed_answers(disagg_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Answers]:
    """What one mixed worker answers to each module's requests (its `reference_answers`),
    by transport: "store" (test_disagg_stack.py) and "tcp" (test_disagg_tcp_stack.py)."""
    import test_disagg_stack as store
    import test_disagg_tcp_stack as tcp

    for stack in store.launch(disagg_model_dir, tmp_path_factory.mktemp("mixed"), workers=1,
                              kvstore=False):
        return {"store": store.reference_answers(stack), "tcp": tcp.reference_answers(stack)}
    raise AssertionError("the reference stack did not start")
