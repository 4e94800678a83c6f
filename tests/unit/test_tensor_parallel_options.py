"""--tensor-parallel-size (-tp) on the worker and on `meshserve up`, and where the launcher
puts each worker's ranks."""

from __future__ import annotations

import pytest
import torch

from meshserve.local.launcher import LauncherConfig, _worker_devices
from meshserve.services.worker.config import WorkerConfig, short_flags
from meshserve.shared.errors import ConfigError


def test_the_worker_takes_tp_in_vllms_short_spelling() -> None:
    assert short_flags(["--model", "m", "-tp", "2", "-tp=4", "--port", "9"]) == [
        "--model", "m", "--tensor-parallel-size", "2", "--tensor-parallel-size", "4",
        "--port", "9"]
    config = WorkerConfig.from_args(short_flags(["-tp", "2"]), environ={})
    assert config.tensor_parallel_size == 2
    assert config.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        WorkerConfig.from_args(["--tensor-parallel-size", "0"], environ={})


def test_up_hands_the_size_on_to_its_workers() -> None:
    config = LauncherConfig.from_args(["--model", "m", "--tensor-parallel-size", "2"],
                                      environ={})
    flags = config.engine_flags()
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"


@pytest.mark.parametrize(("gpus", "workers", "devices", "share"), [
    (4, 2, ["cuda:0", "cuda:2"], None),  # a group of 2 GPUs each
    (2, 2, ["cuda:0", "cuda:0"], "0.450"),  # both on the one group, sharing its memory
    (3, 1, ["cuda:0"], None),  # the odd GPU is left out
])
def test_each_worker_gets_a_group_of_consecutive_gpus(
        monkeypatch: pytest.MonkeyPatch, gpus: int, workers: int, devices: list[str],
        share: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = LauncherConfig(model="m", workers=workers, tensor_parallel_size=2)
    placed = _worker_devices(config)
    assert [flags[flags.index("--device") + 1] for flags in placed] == devices
    shares = [flags[flags.index("--gpu-memory-utilization") + 1]
              for flags in placed if "--gpu-memory-utilization" in flags]
    assert shares == ([] if share is None else [share] * workers)


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="needs 2 GPUs; 1 found"):
        _worker_devices(LauncherConfig(model="m", tensor_parallel_size=2))


def test_a_pooling_worker_is_refused_more_than_one_rank() -> None:
    with pytest.raises(ConfigError, match="pooling worker runs on one device"):
        WorkerConfig.from_args(short_flags(["--runner", "pooling", "-tp", "2"]), environ={})


def test_cpu_ranks_and_a_disabled_custom_all_reduce_sum_through_torch_distributed() -> None:
    import torch

    from meshserve.services.worker.parallel.device_sum import DeviceSum

    x = torch.ones(4, 8, dtype=torch.bfloat16)
    assert not DeviceSum.create(torch.device("cpu"), torch.bfloat16, True).takes_one_shot(x)
    assert not DeviceSum.create(torch.device("cuda", 0), torch.bfloat16,
                                False).takes_one_shot(x)


def test_disable_custom_all_reduce_reaches_the_engine_config() -> None:
    from meshserve.services.worker.config import EngineConfig

    options = EngineConfig.from_args(["--disable-custom-all-reduce"])
    assert options.disable_custom_all_reduce is True
    assert EngineConfig.from_args([]).disable_custom_all_reduce is False


def test_lora_with_tensor_parallelism_is_accepted() -> None:
    from meshserve.services.worker.config import EngineConfig

    # Each rank holds its part of every adapter (tests/engine/test_tensor_parallel_lora.py).
    config = EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2, max_loras=2)
    assert (config.enable_lora, config.tensor_parallel_size) == (True, 2)


def test_a_draft_model_that_is_the_target_at_tp_or_with_lora_is_refused_by_name() -> None:
    from meshserve.services.worker.config import EngineConfig
    from meshserve.shared.errors import ConfigError

    draft = '{"model": "d", "num_speculative_tokens": 3}'
    # Another model as draft is whole on rank 0 (tests/engine/test_tensor_parallel_draft.py).
    assert EngineConfig(model="m", speculative_config=draft,
                        tensor_parallel_size=2).speculative is not None
    itself = '{"model": "m", "num_speculative_tokens": 3}'
    with pytest.raises(ConfigError, match="the target model itself") as no:
        EngineConfig(model="m", speculative_config=itself, tensor_parallel_size=2)
    assert no.value.param == "speculative_config"
    assert EngineConfig(model="m", speculative_config=itself).speculative is not None
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    # n-gram speculation is accepted at TP=2 (tests/engine/test_tensor_parallel.py).
    assert EngineConfig(model="m", speculative_config=spec,
                        tensor_parallel_size=2).speculative is not None
    assert EngineConfig(model="m", speculative_config=spec).speculative is not None
    # n-gram with LoRA is accepted (tests/engine/test_lora_engine.py runs the two together),
    # as is another draft model (tests/engine/test_tensor_parallel_draft.py); the target
    # itself as draft with LoRA is refused.
    assert EngineConfig(model="m", speculative_config=spec,
                        enable_lora=True).speculative is not None
    assert EngineConfig(model="m", speculative_config=draft,
                        enable_lora=True).speculative is not None
    with pytest.raises(ConfigError, match="--enable-lora") as no:
        EngineConfig(model="m", speculative_config=itself, enable_lora=True)
    assert no.value.param == "speculative_config"
