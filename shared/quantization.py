"""Which weight quantization a model runs with: `--quantization` and the checkpoint's own
`quantization_config` (config.json), read into one `QuantConfig`.

Supported, as vLLM reads them:
- `--quantization fp8` on an unquantized checkpoint: weights quantized to FP8 at load.
- `quant_method: "fp8"` checkpoints: float8_e4m3fn weights with `weight_scale` (per tensor)
  or, with `weight_block_size` [bn, bk], `weight_scale_inv` (one per tile, multiplied in
  despite its name); `activation_scheme` dynamic or static.
- `quant_method: "compressed-tensors"` FP8 checkpoints (format float-quantized or
  naive-quantized): 8-bit float weights, strategy tensor, channel or block, `weight_scale`.
- `quant_method: "mxfp4"`, gpt-oss's published checkpoints: the experts in MXFP4, which the
  model dequantizes on load (services/worker/models/gpt_oss.py); no `QuantConfig`, the
  model then runs as from an unquantized checkpoint.

Activations are always quantized per token at run time: a checkpoint's static
`input_scale`s are not needed for that and are left unused (the load says so in its log).
Torch-free, so the launcher can check a model folder without loading it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from meshserve.shared.errors import ModelLoadError

SUPPORTED = ("fp8",)
"""`--quantization` values served."""
# Architectures whose model module reads MXFP4 experts (dequantized on load).
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)


@dataclass(frozen=True)
class QuantConfig:
    """How the decoder's linear layers hold their weights."""

    method: str  # "fp8"
    checkpoint_format: str | None  # "fp8" | "compressed-tensors"; None: quantized at load
    weight_block: tuple[int, int] | None = None  # block-wise scales' tile [bn, bk]
    static_input_scales: bool = False  # the checkpoint carries input_scale tensors
    ignored: tuple[str, ...] = ()  # Hugging Face module names left unquantized
    lm_head: bool = False  # --quantize-lm-head: the LM head in FP8 too (quantized at load)

    @property
    def from_checkpoint(self) -> bool:
        """Whether the checkpoint's weights are stored already quantized."""
        return self.checkpoint_format is not None

    def ignores(self, module_name: str) -> bool:
        """Whether the module of this Hugging Face name stays in the model's dtype: a listed
        name (or name suffix), or a `re:` pattern (compressed-tensors' spelling)."""
        return any(re.fullmatch(name[3:], module_name) if name.startswith("re:")
                   else module_name == name or module_name.endswith("." + name)
                   for name in self.ignored)


def check_option(value: str | None) -> None:
    """Refuse a `--quantization` value that is not served, naming the supported ones."""
    if value is not None and value not in SUPPORTED:
        raise ModelLoadError(f"--quantization {value!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED)}; FP8 checkpoints are detected from "
                             f"their config.json)", param="quantization")


def quantization_of(hf_config: dict[str, Any], requested: str | None,
                    source: str = "config.json") -> QuantConfig | None:
    """The quantization to run: the checkpoint's when it has one, else `requested`."""
    check_option(requested)
    qc = hf_config.get("quantization_config")
    if not qc:
        return None if requested is None else QuantConfig(method="fp8", checkpoint_format=None)
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object",
                             param="quantization_config")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_format(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "mxfp4":
        return _mxfp4(hf_config, requested, source)
    raise ModelLoadError(f"{source}: quant_method {method!r} is not supported (supported: "
                         f"fp8, compressed-tensors FP8)", param="quantization_config")


def _mxfp4(hf_config: dict[str, Any], requested: str | None,
           source: str) -> QuantConfig | None:
    """MXFP4 experts, dequantized by the model as it loads them: what runs is what an
    unquantized checkpoint of the model runs (`requested` as for one)."""
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(MXFP4_ARCHITECTURES):
        raise ModelLoadError(f"{source}: quant_method 'mxfp4' is supported for "
                             f"{', '.join(MXFP4_ARCHITECTURES)} only, not {architectures}",
                             param="quantization_config")
    return None if requested is None else QuantConfig(method="fp8", checkpoint_format=None)


def _fp8_format(qc: dict[str, Any], source: str) -> QuantConfig:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"{source}: activation_scheme {scheme!r} must be dynamic or "
                             "static", param="quantization_config.activation_scheme")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{source}: FP8 weights in {qc.get('fmt')!r}: only e4m3 is "
                             "supported", param="quantization_config.fmt")
    block = qc.get("weight_block_size")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    return QuantConfig(method="fp8", checkpoint_format="fp8",
                       weight_block=_block(block, source) if block else None,
                       static_input_scales=scheme == "static", ignored=tuple(ignored))


def _compressed_tensors(qc: dict[str, Any], source: str) -> QuantConfig:
    param = "quantization_config"
    fmt = qc.get("format", "float-quantized")
    groups = qc.get("config_groups") or {}
    if fmt not in ("float-quantized", "naive-quantized") or len(groups) != 1:
        raise ModelLoadError(f"{source}: compressed-tensors format {fmt!r} with "
                             f"{len(groups)} config groups: only one FP8 group in "
                             "float-quantized or naive-quantized format is supported",
                             param=param)
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ModelLoadError(f"{source}: compressed-tensors weights of {weights.get('num_bits')}"
                             f" bits, type {weights.get('type')!r}: only 8-bit float (FP8) is "
                             "supported", param=param)
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "block"):
        raise ModelLoadError(f"{source}: weight strategy {strategy!r} is not supported "
                             "(tensor, channel or block)", param=param)
    block = _block(weights.get("block_structure"), source) if strategy == "block" else None
    activations = group.get("input_activations") or {}
    return QuantConfig(method="fp8", checkpoint_format="compressed-tensors", weight_block=block,
                       static_input_scales=bool(activations) and not activations.get("dynamic"),
                       ignored=tuple(qc.get("ignore") or ()))


def _block(value: Any, source: str) -> tuple[int, int]:
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ModelLoadError(f"{source}: the weight block size must be two positive integers, "
                             f"got {value!r}", param="quantization_config.weight_block_size")
    return int(value[0]), int(value[1])
