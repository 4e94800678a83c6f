"""`vllm serve` command lines on `meshserve serve`: vLLM's spellings, --config YAML files
(flags after it win), 4k-style sizes, and a clear refusal of what meshserve lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.cli.up import positional_model
from meshserve.cli.vllm_options import translate
from meshserve.local.launcher import LauncherConfig
from meshserve.shared.config import human_int
from meshserve.shared.errors import ConfigError
from meshserve.shared.lora_config import LoraModule, parse_lora_modules


def config_of(*argv: str) -> LauncherConfig:
    return LauncherConfig.from_args(translate(positional_model(argv)), environ={})


def test_vllm_spellings_give_the_same_config_as_ours() -> None:
    theirs = config_of("m", "--data-parallel-size", "3", "--disable-uvicorn-access-log",
                       "--kv-cache-memory-bytes=2G", "-tp", "1", "--uvicorn-log-level",
                       "warning", "--structured-outputs-config", '{"backend": "xgrammar"}',
                       "--disable-log-requests", "--max-model-len", "4k")
    ours = config_of("--model", "m", "--workers", "3", "--no-access-log", "--kv-cache-memory",
                     str(2 * 2**30), "--log-level", "WARNING", "--max-model-len", "4000")
    assert theirs == ours


@pytest.mark.parametrize("argv", [["--pipeline-parallel-size", "2"], ["-pp=4"],
                                  ["--quantization", "awq"], ["--enable-sleep-mode"],
                                  ["--kv-cache-dtype", "int8"], ["--tokenizer", "x"]])
def test_unsupported_vllm_options_are_refused_by_name(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="not supported by meshserve") as refused:
        translate(argv)
    assert argv[0].split("=")[0] in refused.value.message


def test_lora_options_are_supported_in_both_spellings(tmp_path: Path) -> None:
    adapter = '{"name": "sql", "path": "/a/sql", "base_model_name": "m"}'
    config = config_of("m", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
                       "--lora-modules", "chat=/a/chat", adapter, "--max-cpu-loras", "8")
    assert (config.enable_lora, config.max_loras, config.max_lora_rank,
            config.max_cpu_loras) == (True, 4, 64, 8)
    modules = parse_lora_modules(config.lora_modules)
    assert modules == (LoraModule("chat", "/a/chat"), LoraModule("sql", "/a/sql", "m"))
    assert parse_lora_modules(config_of("m", "--enable-lora", "--lora-modules", "a=/x",
                                        "b=/y").lora_modules) == (LoraModule("a", "/x"),
                                                                  LoraModule("b", "/y"))
    path = tmp_path / "serve.yaml"
    path.write_text("enable_lora: true\nlora_modules:\n  - {name: sql, path: /a/sql}\n")
    from_file = config_of("m", "--config", str(path))
    assert parse_lora_modules(from_file.lora_modules) == (LoraModule("sql", "/a/sql"),)
    with pytest.raises(ConfigError, match="lora_modules"):
        config_of("m", "--lora-modules", "a=/x")  # without --enable-lora
    with pytest.raises(ConfigError, match="generation workers only"):
        config_of("m", "--runner", "pooling", "--enable-lora")


def test_harmless_values_of_unsupported_options_pass() -> None:
    assert translate(["--pipeline-parallel-size", "1", "--port", "9"]) == ["--port", "9"]


def test_task_embed_is_a_pooling_runner_and_other_tasks_are_refused() -> None:
    assert config_of("m", "--task", "embed") == config_of("m", "--runner", "pooling",
                                                          "--convert", "embed")
    assert config_of("m", "--task", "generate") == config_of("m")
    assert config_of("m", "--task", "embed").pooling
    with pytest.raises(ConfigError, match="--task classify"):
        translate(["--task", "classify"])


def test_a_config_file_is_read_and_flags_after_it_win(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("max_model_len: 2k\nenable-prefix-caching: false\nworkers: 2\n"
                    "data-parallel-size: 3\nport: 8100\n")
    config = config_of("m", "--config", str(path), "--port", "8200")
    assert (config.max_model_len, config.enable_prefix_caching, config.workers,
            config.port) == (2000, False, 3, 8200)
    path.write_text("max_model_lenn: 5\n")
    with pytest.raises(ConfigError, match="max-model-lenn"):
        config_of("m", "--config", str(path))
    path.write_text("pipeline_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="not supported"):
        config_of("m", "--config", str(path))


def test_tensor_parallel_size_is_taken_in_every_spelling(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("tensor_parallel_size: 2\n")
    configs = [config_of("m", "-tp", "2"), config_of("m", "-tp=2"),
               config_of("m", "--tensor-parallel-size=2"), config_of("m", "--config", str(path))]
    assert [c.tensor_parallel_size for c in configs] == [2, 2, 2, 2]


@pytest.mark.parametrize(("text", "value"), [("4k", 4000), ("4K", 4096), ("1.5k", 1500),
                                             ("25.6k", 25600), ("2M", 2 * 2**20),
                                             ("3g", 3 * 10**9), ("17", 17)])
def test_sizes_read_as_vllm_reads_them(text: str, value: int) -> None:
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "0.0001k", "k", "4x"])
def test_bad_sizes_are_errors(text: str) -> None:
    with pytest.raises(ValueError):
        human_int(text)
