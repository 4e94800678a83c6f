"""Programmatic dependent launch: where it is on, and the launch options it gives."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from meshserve.kernels import knobs, pdl
from meshserve.kernels.knobs import KernelKnobs
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.errors import ConfigError


def test_off_the_gpu_kernels_launch_without_pdl() -> None:
    assert pdl.mode(torch.device("cpu")) == 0
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": 0}


@pytest.fixture
def restore_knobs() -> Iterator[None]:
    previous = knobs.current()
    yield
    knobs.use(previous)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_requested_mode_comes_from_the_kernel_knobs(restore_knobs: None, mode: int) -> None:
    knobs.use(KernelKnobs(pdl=mode))  # type: ignore[arg-type]
    assert pdl.requested_mode() == mode


def test_the_default_mode_waits_and_lets_the_next_kernel_in(restore_knobs: None) -> None:
    knobs.use(KernelKnobs())
    assert pdl.requested_mode() == 2


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, 2), (["--pdl", "1"], {}, 1), ([], {"MESHSERVE_PDL": "0"}, 0),
    (["--pdl", "2"], {"MESHSERVE_PDL": "0"}, 2)])
def test_the_worker_option_and_its_variable_choose_the_mode(
        argv: list[str], env: dict[str, str], expected: int) -> None:
    config = EngineConfig.from_args(argv, environ=env)
    assert config.kernel_knobs.pdl == expected


@pytest.mark.parametrize("raw", ["on", "3", "-1", ""])
def test_an_unknown_mode_is_a_config_error_naming_the_option(raw: str) -> None:
    with pytest.raises(ConfigError, match="pdl"):
        EngineConfig.from_args([], environ={"MESHSERVE_PDL": raw})
    with pytest.raises(AssertionError, match="pdl"):
        KernelKnobs(pdl=raw)  # type: ignore[arg-type]
