"""Programmatic dependent launch: where it is on, and the launch options it gives."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import pdl


def test_off_the_gpu_kernels_launch_without_pdl() -> None:
    assert pdl.mode(torch.device("cpu")) == 0
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": 0}


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("1", 1), (" 2 ", 2)])
def test_the_requested_mode_comes_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, raw: str, expected: int) -> None:
    monkeypatch.setenv(pdl.ENV, raw)
    assert pdl.requested_mode() == expected


def test_the_default_mode_waits_and_lets_the_next_kernel_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.requested_mode() == 2


@pytest.mark.parametrize("raw", ["on", "3", "-1", ""])
def test_an_unknown_mode_is_an_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(pdl.ENV, raw)
    with pytest.raises(ValueError, match=pdl.ENV):
        pdl.requested_mode()
