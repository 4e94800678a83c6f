"""The config pattern: frozen dataclasses built from flags over environment over defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from meshserve.shared.config import ServiceConfig, option
from meshserve.shared.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig(ServiceConfig):
    """A service config as a service would declare it."""

    port: int = option(50099, "port of the demo service")
    block_size: int = option(16, "tokens per KV block")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights and KV")
    enforce_eager: bool = option(False, "run without CUDA graphs")
    model_path: Path = option("dummy", "model folder or GGUF file")  # noqa: RUF009 (a field)
    served_model_names: tuple[str, ...] = option(("default",), "names the model is served under")
    kv_dtype: Literal["auto", "fp8"] = option("auto", "KV cache element type")
    redis_url: str | None = option(None, "external Redis (unset: embedded)")

    def validate(self) -> None:
        super().validate()
        self.require(0 < self.gpu_memory_utilization <= 1,
                     f"must be in (0, 1], got {self.gpu_memory_utilization}",
                     "gpu_memory_utilization")

    @property
    def block_bytes_per_token(self) -> int:
        return 2 * self.block_size


def test_defaults_and_derived_values() -> None:
    config = DemoConfig.from_args([], environ={})
    assert config.port == 50099
    assert config.model_path == Path("dummy")  # the str default became a Path
    assert config.listen_address == "127.0.0.1:50099"
    assert config.served_model_names == ("default",)
    assert config.redis_url is None
    assert config.block_bytes_per_token == 32
    assert DemoConfig(host="::1", port=1).listen_address == "[::1]:1"


def test_environment_is_parsed_per_field_type() -> None:
    config = DemoConfig.from_args([], environ={
        "MESHSERVE_PORT": "7000", "MESHSERVE_GPU_MEMORY_UTILIZATION": "0.5",
        "MESHSERVE_ENFORCE_EAGER": "yes", "MESHSERVE_MODEL_PATH": "/models/x",
        "MESHSERVE_SERVED_MODEL_NAMES": "a, b", "MESHSERVE_KV_DTYPE": "fp8",
        "MESHSERVE_REDIS_URL": "redis://h:1", "PATH": "/usr/bin"})
    assert (config.port, config.gpu_memory_utilization, config.enforce_eager) == (7000, 0.5, True)
    assert config.model_path == Path("/models/x")
    assert config.served_model_names == ("a", "b")
    assert (config.kv_dtype, config.redis_url) == ("fp8", "redis://h:1")


def test_flags_override_environment() -> None:
    environ = {"MESHSERVE_PORT": "7000", "MESHSERVE_ENFORCE_EAGER": "true",
               "MESHSERVE_BLOCK_SIZE": "32"}
    config = DemoConfig.from_args(["--port", "7001", "--no-enforce-eager"], environ=environ)
    assert (config.port, config.enforce_eager, config.block_size) == (7001, False, 32)


def test_standard_variable_alias_and_its_precedence() -> None:
    alias = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}
    assert DemoConfig.from_args([], environ=alias).otlp_endpoint == "collector:4317"
    both = {**alias, "MESHSERVE_OTLP_ENDPOINT": "other:4317"}
    assert DemoConfig.from_args([], environ=both).otlp_endpoint == "other:4317"


def test_unknown_environment_variable_is_an_error_unless_shared() -> None:
    environ = {"MESHSERVE_PROT": "7000"}
    with pytest.raises(ConfigError, match="MESHSERVE_PROT") as info:
        DemoConfig.from_args([], environ=environ)
    assert info.value.param == "MESHSERVE_PROT"
    assert DemoConfig.from_args([], environ=environ, strict_env=False).port == 50099


def test_unknown_flag_and_unknown_key_are_errors() -> None:
    with pytest.raises(ConfigError, match="--prot"):
        DemoConfig.from_args(["--prot", "1"], environ={})
    with pytest.raises(ConfigError, match="unknown keys for DemoConfig: prot") as info:
        DemoConfig.from_mapping({"port": 1, "prot": 2})
    assert info.value.param == "prot"


@pytest.mark.parametrize(("environ", "field", "source"), [
    ({"MESHSERVE_PORT": "seventy"}, "port", "environment"),
    ({"MESHSERVE_ENFORCE_EAGER": "maybe"}, "enforce_eager", "environment"),
    ({"MESHSERVE_KV_DTYPE": "fp4"}, "kv_dtype", "environment"),
])
def test_bad_values_name_field_and_source(environ: dict[str, str], field: str,
                                          source: str) -> None:
    with pytest.raises(ConfigError, match=f"DemoConfig.{field} from {source}") as info:
        DemoConfig.from_args([], environ=environ)
    assert info.value.param == field


def test_bad_flag_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="DemoConfig.block_size from flag --block-size"):
        DemoConfig.from_args(["--block-size", "x"], environ={})
    with pytest.raises(ConfigError, match="invalid choice"):
        DemoConfig.from_args(["--kv-dtype", "fp4"], environ={})


def test_validated_on_construction() -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization: must be in") as info:
        DemoConfig(gpu_memory_utilization=1.5)
    assert info.value.param == "gpu_memory_utilization"
    with pytest.raises(ConfigError, match="port: must be in"):
        DemoConfig.from_args(["--port", "70000"], environ={})
    with pytest.raises(ConfigError, match="DemoConfig.block_size: expected int"):
        DemoConfig(block_size="16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected int"):
        DemoConfig(block_size=True)


def test_construction_normalises_compatible_values() -> None:
    config = DemoConfig.from_mapping({"gpu_memory_utilization": 1, "served_model_names": ["x"],
                                      "model_path": "/m", "block_size": "8"})
    assert config.gpu_memory_utilization == 1.0 and isinstance(config.gpu_memory_utilization,
                                                               float)
    assert config.served_model_names == ("x",)
    assert config.model_path == Path("/m")
    assert config.block_size == 8


def test_frozen() -> None:
    config = DemoConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


def test_flags_carry_help_text_and_env_name() -> None:
    text = " ".join(DemoConfig.parser(prog="demo").format_help().split())
    assert "--gpu-memory-utilization GPU_MEMORY_UTILIZATION fraction of GPU memory" in text
    assert "env MESHSERVE_GPU_MEMORY_UTILIZATION" in text
    assert "--enforce-eager, --no-enforce-eager" in text


def test_empty_value_unsets_an_optional_field() -> None:
    config = DemoConfig.from_args(["--redis-url", ""], environ={"MESHSERVE_REDIS_URL": "r://x"})
    assert config.redis_url is None


def test_mutable_defaults_are_refused() -> None:
    with pytest.raises(TypeError, match="immutable"):
        option(["a"], "a list")


def test_a_flag_is_never_read_from_its_abbreviation() -> None:
    from meshserve.local.launcher import LauncherConfig

    # `--tokenizer` is not `--tokenizers` (argparse would expand the prefix by default).
    with pytest.raises(ConfigError) as refused:
        LauncherConfig.from_args(["--tokenizer", "2"], prog="meshserve up")
    assert "unrecognized arguments: --tokenizer 2" in refused.value.message
    # Whoever prints the error names the program: the message does not.
    assert not refused.value.message.startswith("meshserve up")
    assert LauncherConfig.from_args(["--tokenizers", "2"], prog="meshserve up").tokenizers == 2


def test_the_model_may_come_first_as_vllm_serve_takes_it() -> None:
    from meshserve.cli.up import positional_model
    from meshserve.local.launcher import LauncherConfig

    argv = positional_model(["org/model", "--port", "0"])
    assert argv == ["--model", "org/model", "--port", "0"]
    assert LauncherConfig.from_args(argv).model == "org/model"
    assert positional_model(["--port", "0"]) == ["--port", "0"]  # no positional: as given
    with pytest.raises(ConfigError, match="given twice"):
        positional_model(["a", "--model=b"])

