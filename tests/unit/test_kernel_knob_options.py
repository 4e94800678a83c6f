"""The kernel knobs are worker options: a standalone worker takes them from flags or its
environment, `meshserve up` hands them on to every worker it starts, and the engine
applies them to the kernels of its process."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.kernels import knobs
from meshserve.kernels.knobs import KernelKnobs
from meshserve.local.launcher import LauncherConfig
from meshserve.services.worker.config import WorkerConfig
from meshserve.shared.errors import ConfigError


def test_a_standalone_worker_takes_the_knobs_from_its_environment() -> None:
    config = WorkerConfig.from_args([], environ={
        "MESHSERVE_PDL": "1", "MESHSERVE_FP8_WIDEN": "bits", "MESHSERVE_TP_FUSED_NORM": "0"})
    assert config.kernel_knobs == KernelKnobs(pdl=1, fp8_widen="bits")
    assert config.tp_fused_norm is False


def test_flags_win_over_the_environment_and_bad_values_name_the_option() -> None:
    config = WorkerConfig.from_args(["--pdl", "0", "--fp8-widen", "cvt"],
                                    environ={"MESHSERVE_PDL": "1", "MESHSERVE_FP8_WIDEN": "bits"})
    assert config.kernel_knobs == KernelKnobs(pdl=0, fp8_widen="cvt")
    with pytest.raises(ConfigError, match="fp8_widen"):
        WorkerConfig.from_args([], environ={"MESHSERVE_FP8_WIDEN": "fast"})


@pytest.mark.parametrize(("argv", "environ"), [
    (["--pdl", "1", "--fp8-widen", "bits", "--no-tp-fused-norm"], {}),
    ([], {"MESHSERVE_PDL": "1", "MESHSERVE_FP8_WIDEN": "bits", "MESHSERVE_TP_FUSED_NORM": "0"}),
])
def test_up_hands_the_knobs_on_to_its_workers(argv: list[str], environ: dict[str, str]) -> None:
    flags = LauncherConfig.from_args(["--model", "m", *argv], environ=environ).engine_flags()
    worker = WorkerConfig.from_args(["--model", "m", *flags], environ={})
    assert worker.kernel_knobs == KernelKnobs(pdl=1, fp8_widen="bits")
    assert worker.tp_fused_norm is False
    assert "--no-tp-fused-norm" in flags


def test_defaults_hand_nothing_on() -> None:
    flags = LauncherConfig.from_args(["--model", "m"], environ={}).engine_flags()
    assert not {"--pdl", "--fp8-widen", "--no-tp-fused-norm"} & set(flags)
    assert WorkerConfig.from_args([], environ={}).kernel_knobs == KernelKnobs()


def test_building_an_engine_applies_its_knobs(tiny_llama_dir: Path) -> None:
    from meshserve.services.worker.builder import build_engine
    from meshserve.services.worker.config import EngineConfig

    previous = knobs.current()
    try:
        build_engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                  num_kv_blocks=8, max_model_len=64, pdl=0,
                                  fp8_widen="bits"))
        assert knobs.current() == KernelKnobs(pdl=0, fp8_widen="bits")
    finally:
        knobs.use(previous)
