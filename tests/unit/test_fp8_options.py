"""`--quantization fp8` and `--kv-cache-dtype fp8*`: vLLM's spellings, the config they give,
the checkpoint's `quantization_config` read into a QuantConfig, and refusals naming what is
supported."""

from __future__ import annotations

import pytest

from meshserve.cli.up import positional_model
from meshserve.cli.vllm_options import translate
from meshserve.local.launcher import LauncherConfig
from meshserve.shared.errors import ConfigError, ModelLoadError
from meshserve.shared.kv_dtype import block_nbytes, kv_cache_dtype_name
from meshserve.shared.quantization import QuantConfig, quantization_of


def config_of(*argv: str) -> LauncherConfig:
    return LauncherConfig.from_args(translate(positional_model(argv)), environ={})


def test_vllm_spellings_of_fp8_reach_the_engine_config() -> None:
    config = config_of("m", "-q", "fp8", "--kv-cache-dtype=fp8_e5m2")
    assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8_e5m2")
    assert config_of("m", "--quantization=fp8", "--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
    assert config_of("m").quantization is None
    assert config_of("m", "--kv-cache-dtype", "auto").kv_cache_dtype == "auto"


@pytest.mark.parametrize(("argv", "supported"), [
    (["--quantization", "awq"], "supported: fp8"), (["-q", "gptq"], "supported: fp8"),
    (["--kv-cache-dtype", "int8"], "supported: auto, fp8, fp8_e4m3, fp8_e5m2")])
def test_other_values_are_refused_naming_the_supported_ones(argv: list[str],
                                                            supported: str) -> None:
    with pytest.raises(ConfigError, match=supported) as refused:
        translate(argv)
    assert argv[0] in refused.value.message


def test_worker_flags_refuse_unknown_values() -> None:
    with pytest.raises(ConfigError, match="quantization"):
        config_of("m", "--quantization", "int4")


def test_kv_cache_dtype_names_and_sizes() -> None:
    assert kv_cache_dtype_name("auto", "bfloat16") == "bfloat16"
    assert kv_cache_dtype_name("fp8", "bfloat16") == "float8_e4m3fn"
    assert kv_cache_dtype_name("fp8_e4m3", "float32") == "float8_e4m3fn"
    assert kv_cache_dtype_name("fp8_e5m2", "float16") == "float8_e5m2"
    assert block_nbytes("float8_e4m3fn", (16, 8, 128)) * 2 == block_nbytes("bfloat16", (16, 8, 128))
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        kv_cache_dtype_name("int8", "bfloat16")


def test_quantization_config_of_each_format() -> None:
    assert quantization_of({}, None) is None
    assert quantization_of({}, "fp8") == QuantConfig(method="fp8", checkpoint_format=None)
    fp8 = quantization_of({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128],
        "ignored_layers": ["lm_head"]}}, None)
    assert fp8 == QuantConfig(method="fp8", checkpoint_format="fp8", weight_block=(128, 128),
                              static_input_scales=True, ignored=("lm_head",))
    assert fp8.from_checkpoint and fp8.ignores("lm_head") and not fp8.ignores("model.norm")
    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
             "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}
    ct = quantization_of({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": group}, "ignore": ["lm_head"]}}, "fp8")
    assert ct == QuantConfig(method="fp8", checkpoint_format="compressed-tensors",
                             ignored=("lm_head",))
    assert ct.ignores("model.layers.0.lm_head") is True
    patterns = QuantConfig(method="fp8", checkpoint_format="compressed-tensors",
                           ignored=("re:.*mlp\\.down_proj",))
    assert patterns.ignores("model.layers.3.mlp.down_proj")
    assert not patterns.ignores("model.layers.3.mlp.up_proj")


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {}}}, "pack-quantized"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "only 8-bit float"),
])
def test_unsupported_checkpoint_quantization_is_refused(qc: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        quantization_of({"quantization_config": qc}, None)


def test_unsupported_option_value_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="supported: fp8"):
        quantization_of({}, "awq")
