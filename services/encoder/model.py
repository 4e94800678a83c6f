"""The encoder service's model: a vision-language model's vision half alone.

The half is built on the meta device and given storage on the service's device, so the
language model's weights are never allocated or read: only the checkpoint tensors under
the half's prefixes are (shared/vision_models.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from meshserve.services.encoder.config import EncoderConfig
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.image_encoding import RowsEncoder, load_image_processor
from meshserve.shared.model_config import read_model_files
from meshserve.shared.model_source import resolve_model
from meshserve.shared.vision_models import VisionPart, build_vision_part

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ServedVision:
    """What the service encodes with, and the names it answers to."""

    names: tuple[str, ...]
    encoder: RowsEncoder
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.names[0]


def resolve_device(name: str) -> torch.device:
    """`auto`: the first GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _dtype(config: EncoderConfig, checkpoint: str | None, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint or "", torch.bfloat16)


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no safetensors weights", param="model")
    return files


def vision_tensors(folder: Path, part: type[VisionPart]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors that `part` owns (the others are never read)."""
    for path in _checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if part.own_name(name) is not None:
                    yield name, f.get_tensor(name)


def load_served_vision(config: EncoderConfig) -> ServedVision:
    """Build the vision half on the device and fill its weights (blocking)."""
    source = resolve_model(config.model)
    if source.format != "hf":
        raise ModelLoadError(f"{config.model}: the encoder runs Hugging Face folders of "
                             "vision-language models", param="model")
    files = read_model_files(source)
    device = resolve_device(config.device)
    checkpoint = files.config.get("torch_dtype") or files.config.get("dtype")
    dtype = _dtype(config, str(checkpoint) if checkpoint else None, device)
    with torch.device("meta"):
        part = build_vision_part(files.config, files.where)
    part = part.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        part.reset_buffers()
        if config.load_format == "dummy":
            generator = torch.Generator(device=device).manual_seed(0)
            for param in part.parameters():
                param.uniform_(-1e-3, 1e-3, generator=generator)
        else:
            part.load(vision_tensors(source.path, type(part)))
    part.eval().requires_grad_(False)
    encoder = RowsEncoder(part, load_image_processor(source.path), device)
    name = config.served_model_name or source.name
    return ServedVision(tuple(dict.fromkeys([name, source.name, config.model])), encoder, dtype)
