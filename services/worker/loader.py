"""Find a model, read its config, and build the module with its weights.

Sources: a Hugging Face folder (safetensors, sharded or not, or pytorch_model.bin), a GGUF file
(dequantized on load through transformers' GGUF reader), a hub id when a hub is reachable, the
default model (see default_model.py), or `dummy` random weights of the right shapes.

With a `QuantConfig` (services/worker/models/quant_fp8.py), the decoder's linear layers hold
FP8 weights: loaded as such from an FP8 checkpoint, else quantized once the weights are in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.services.worker.models.quant_fp8 import (
    load_fp8_checkpoint,
    prepare_checkpoint_layers,
    quantize_lm_head,
    quantize_online,
)
from meshserve.services.worker.models.registry import get_model_class, refuse_unsupported
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.model_config import MODEL_TYPE_ARCHITECTURES, read_json, read_model_files
from meshserve.shared.model_source import (  # noqa: F401 (re-exported)
    LOAD_FORMATS,
    ModelSource,
    resolve_model,
)
from meshserve.shared.quantization import QuantConfig, quantization_of

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from meshserve.services.worker.parallel.config import ShardPlan

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}
_DUMMY_SEED = 0
_DUMMY_RANGE = 1e-3


def load_model_config(source: ModelSource) -> ModelConfig:
    """The model's config from config.json (+ generation_config.json) or GGUF metadata; a
    vision-language folder's with its image processor's settings."""
    files = read_model_files(source)
    config = ModelConfig.from_hf(files.config, generation_config=files.generation,
                                 source=files.where)
    if config.vision is not None and source.format == "hf":
        from meshserve.shared.image_encoding import load_image_processor

        settings = load_image_processor(source.path).to_dict()  # type: ignore[attr-defined]
        config = replace(config, image_processor=settings)
    return config


def load_quant_config(source: ModelSource, requested: str | None) -> QuantConfig | None:
    """The weight quantization to run: the checkpoint's (config.json) or `--quantization`."""
    files = read_model_files(source)
    return quantization_of(files.config, requested, files.where)


def load_model(source: ModelSource, config: ModelConfig, dtype: torch.dtype,
               device: torch.device, load_format: str,
               model_class: type[CausalLM] | None = None,
               shard: ShardPlan | None = None,
               quant: QuantConfig | None = None) -> CausalLM:
    """Build the model on `device` in `dtype` and fill its weights from the source.

    `model_class` replaces the architecture's own class (a pooling worker's embedder).
    `shard`: build this tensor-parallel rank's part of the model and load only its slices
    (dummy weights are drawn per slice, on the device). `quant` gives the decoder's linear
    layers FP8 weights (and the LM head, with `quant.lm_head`)."""
    dummy = load_format == "dummy" or source.format == "dummy"
    fp8_checkpoint = quant is not None and quant.from_checkpoint and not dummy
    _check_source(source, config, dummy, quant)
    assert not (fp8_checkpoint and shard is not None), \
        "FP8 checkpoints are refused at tensor parallelism before the model is built"
    model = _materialize(config, dtype, device, model_class, shard,
                         quant if fp8_checkpoint else None)
    if dummy:
        _fill_dummy(model, device)
    elif source.format == "gguf":
        _load_gguf(model, source.gguf_file or source.path, config, dtype, shard)
    else:
        _load_hf(model, source.path, shard, quant if fp8_checkpoint else None)
    if quant is not None and not fp8_checkpoint:
        quantize_online(model)
    if quant is not None and quant.lm_head:
        quantize_lm_head(model)
    model.requires_grad_(False)
    return model.eval()


def _check_source(source: ModelSource, config: ModelConfig, dummy: bool,
                  quant: QuantConfig | None) -> None:
    """Refuse by name the formats and quantizations the architecture does not load from yet
    (models/registry.py)."""
    if source.format == "gguf" and not dummy:
        refuse_unsupported(config.architecture, "gguf")
    if quant is None:
        return
    refuse_unsupported(config.architecture,
                       "fp8_checkpoint" if quant.from_checkpoint and not dummy else "fp8")


def _materialize(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 model_class: type[CausalLM] | None = None,
                 shard: ShardPlan | None = None,
                 fp8_layers: QuantConfig | None = None) -> CausalLM:
    """Allocate without initialising: build on the meta device, then give it real storage."""
    with torch.device("meta"):
        cls = model_class or get_model_class(config.architecture)
        if shard is None:
            model = cls(config)
        else:
            from meshserve.services.worker.parallel.layers import shard_modules

            model = cls(shard.local_config())
            shard_modules(model, shard)
    model = model.to(dtype=dtype)
    if fp8_layers is not None:  # after the cast to dtype, which would widen FP8 weights
        prepare_checkpoint_layers(model, fp8_layers)
    model = model.to_empty(device=device)
    if shard is not None:
        from meshserve.services.worker.parallel.layers import bind_device_sum

        bind_device_sum(model, shard, device, dtype)
    model.reset_buffers()
    return model


def _fill_dummy(model: CausalLM, device: torch.device) -> None:
    """Small uniform weights from a fixed seed: realistic shapes and speed, no files read."""
    generator = torch.Generator(device=device).manual_seed(_DUMMY_SEED)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-_DUMMY_RANGE, _DUMMY_RANGE, generator=generator)


def _load_hf(model: CausalLM, folder: Path, shard: ShardPlan | None = None,
             quant: QuantConfig | None = None) -> None:
    files = checkpoint_files(folder)
    try:
        if quant is None:
            model.load_weights(_iter_checkpoint(files, shard))
        else:
            load_fp8_checkpoint(model, _iter_checkpoint(files), quant)
    except ModelLoadError as exc:
        if str(folder) in exc.message:
            raise
        raise ModelLoadError(f"{folder}: {exc.message}", param=exc.param) from exc


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, sharded (with an index) or single."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            return _index_shards(index)
        single = folder / index_name.removesuffix(".index.json")
        if single.is_file():
            return [single]
    raise ModelLoadError(
        f"no weights in {folder}: looked for model.safetensors(.index.json) and "
        f"pytorch_model.bin(.index.json)", param="model")


def _index_shards(index: Path) -> list[Path]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no 'weight_map'", param=index.name)
    shards = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"shard {shard.name} listed in {index.name} is missing from "
                                 f"{index.parent}", param=shard.name)
    return shards


def _iter_checkpoint(files: list[Path], shard: ShardPlan | None = None,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from each file; a corrupt file is named in the error.

    With `shard`, only this rank's slice of each tensor (read from safetensors as a slice:
    the rest of the tensor is never read), under the rank's name for it; tensors of other
    ranks' experts (expert parallelism) are skipped unread."""
    from safetensors import safe_open

    for path in files:
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        if shard is None:
                            yield name, f.get_tensor(name)
                        elif (local := shard.local_name(name)) is not None:
                            yield local, shard.take(name, f.get_slice(name))
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                for name, tensor in state.items():
                    if shard is None:
                        yield name, tensor
                    elif (local := shard.local_name(name)) is not None:
                        yield local, shard.take(name, tensor)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors and torch raise many kinds
            raise ModelLoadError(f"cannot read weights file {path}: {exc}",
                                 param=path.name) from exc


def _load_gguf(model: CausalLM, gguf_file: Path, config: ModelConfig,
               dtype: torch.dtype, shard: ShardPlan | None = None) -> None:
    """Dequantize the GGUF's tensors with transformers' reader, under Hugging Face names.

    The reader maps GGUF names to those of a Hugging Face model (built here on the meta
    device, so it costs no memory) and undoes llama.cpp's q/k row permutation. Quantized
    GGUF types (Q8_0, Q4_K, ...) are not kept: the weights are served in `dtype`, at that
    dtype's size (logged), unless `--quantization fp8` requantizes the decoder to FP8.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    dense = sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8
    log.warning("GGUF weights of %s are dequantized to %s on load: %.2f GiB in memory whatever "
                "the file's quantization (%.2f GiB on disk); --quantization fp8 halves the "
                "decoder's share on top of that", gguf_file.name, str(dtype).removeprefix(
                    "torch."), dense / 2**30, gguf_file.stat().st_size / 2**30)

    try:
        parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True,
                                      model_to_load=_NameMap(_hf_skeleton(config)),
                                      torch_dtype=dtype)
    except Exception as exc:  # gguf raises many kinds on a bad file
        raise ModelLoadError(f"{gguf_file}: cannot read GGUF tensors: {exc}",
                             param=gguf_file.name) from exc
    tensors = parsed["tensors"].items()
    if shard is not None:  # dequantized whole: GGUF files hold small models
        tensors = ((name, shard.take(name, tensor)) for name, tensor in tensors)
    try:
        model.load_weights(tensors)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{gguf_file}: {exc.message}", param=exc.param) from exc


class _NameMap:
    """What transformers' GGUF name mapping reads from a model: its config and parameter names.

    Without children: the mapping otherwise repeats itself for every submodule, which costs
    seconds and only matters for checkpoints saved from a base model (not our architectures).
    """

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.config = hf_model.config
        self._state = hf_model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_children(self) -> list[tuple[str, torch.nn.Module]]:
        return []


def _hf_skeleton(config: ModelConfig) -> torch.nn.Module:
    """A transformers model of the same shapes on the meta device (for its parameter names)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # gguf-py names Mistral tensors as Llama ones (llama.cpp runs both as "llama").
    model_type = "llama" if config.architecture == "MistralForCausalLM" else next(
        t for t, arch in MODEL_TYPE_ARCHITECTURES.items() if arch == config.architecture)
    hf_config = AutoConfig.for_model(
        model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, head_dim=config.head_dim,
        num_key_value_heads=config.num_key_value_heads, attention_bias=config.o_proj_bias,
        tie_word_embeddings=config.tie_word_embeddings)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU; on CUDA the checkpoint's dtype, float32 checkpoints as
    bfloat16. Otherwise one of bfloat16 | float16 | float32 (and their short names)."""
    if name != "auto":
        if name not in _DTYPES:
            raise ModelLoadError(f"dtype {name!r} is not one of auto, bfloat16, float16, float32",
                                 param="dtype")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    checkpoint = _DTYPES.get(config.torch_dtype or "", torch.float32)
    return torch.bfloat16 if checkpoint == torch.float32 else checkpoint
