"""EngineConfig's device-dependent defaults and its checks."""

from __future__ import annotations

import pytest

from meshserve.services.worker.config import EngineConfig, GiB
from meshserve.shared.errors import ConfigError


@pytest.mark.parametrize(("memory", "name", "want"), [
    (80 * GiB, "NVIDIA H100 80GB HBM3", 1024),
    (141 * GiB, "NVIDIA H200", 1024),
    (80 * GiB, "NVIDIA A100-SXM4-80GB", 256),  # large, but big batches do not pay off there
    (24 * GiB, "NVIDIA L4", 256),
    (0, "", 256),  # CPU
])
def test_max_num_seqs_default_follows_the_device(memory: int, name: str, want: int) -> None:
    assert EngineConfig().seqs_limit(memory, name) == want


def test_an_explicit_max_num_seqs_wins() -> None:
    assert EngineConfig(max_num_seqs=64).seqs_limit(80 * GiB, "NVIDIA H100") == 64
    with pytest.raises(ConfigError, match="max-num-seqs"):
        EngineConfig(max_num_seqs=0)
