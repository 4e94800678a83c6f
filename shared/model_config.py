"""Reading a model's configuration without torch: config.json, generation_config.json, GGUF.

Every service that needs facts about a model (the worker's shapes, the tokenizer's context
length) reads them through here, so that they agree:

    files = read_model_files(source)        # ModelFiles(config, generation, where)
    context_length(files.config)            # max_model_len as the worker serves it

A GGUF file's metadata is read by transformers' GGUF support, which imports torch. The
torch-free services get it through `gguf_export`: one child process turns the file's
config and tokenizer into a small Hugging Face folder, cached on disk, which they read
like any other folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from meshserve.shared.errors import ModelLoadError

# Hugging Face `model_type` -> architecture, for configs without `architectures` (GGUF).
MODEL_TYPE_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# Vision-language architectures -> the text architecture their language model runs as when
# its config names none (Qwen2.5-VL's checkpoints keep the text fields at the top level).
VISION_ARCHITECTURES: dict[str, str] = {
    "LlavaForConditionalGeneration": "LlamaForCausalLM",
    # (its text_config names llama for Vicuna, Yi and Llama 3, mistral or qwen2)
    "LlavaNextForConditionalGeneration": "LlamaForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
}
# `text_config.model_type` of vision-language models -> the language model's architecture.
_TEXT_MODEL_TYPES: dict[str, str] = {**MODEL_TYPE_ARCHITECTURES,
                                     "gemma3_text": "Gemma3ForCausalLM"}
# transformers' defaults of the text config class, for the fields the worker and tokenizer
# read, where published configs leave them out: gemma-3-4b-it's text_config names only the
# few that differ from Gemma3TextConfig's.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "sliding_window": 4096, "tie_word_embeddings": True,
    },
}
# Fields of a vision-language config that its language model inherits when the text config
# lacks them.
_INHERITED = ("eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype",
              "tie_word_embeddings")


class SourceLike(Protocol):
    """Where a model lives (`meshserve.shared.model_source.ModelSource`, a frozen dataclass:
    the members are read-only)."""

    @property
    def path(self) -> Path: ...
    @property
    def gguf_file(self) -> Path | None: ...


@dataclass(frozen=True)
class ModelFiles:
    """The raw configuration dicts of a model and where they came from (for errors)."""

    config: dict[str, Any]
    generation: dict[str, Any] | None
    where: str


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ModelLoadError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON: {exc}", param=path.name) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object", param=path.name)
    return data


def read_folder(folder: Path) -> ModelFiles:
    """config.json (required) and generation_config.json (optional) of a model folder."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path} is missing", param="config.json")
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    return ModelFiles(read_json(config_path), generation, str(config_path))


def read_model_files(source: SourceLike) -> ModelFiles:
    """The configuration of a model folder, or of a GGUF file through its exported folder."""
    if source.gguf_file is not None:
        from meshserve.shared.gguf_export import exported_folder

        files = read_folder(exported_folder(source.gguf_file))
        return ModelFiles(files.config, None, str(source.gguf_file))
    return read_folder(source.path)


def architecture_of(cfg: dict[str, Any], where: str) -> str:
    """The architecture a config names (`architectures[0]`, else from `model_type`)."""
    architectures = cfg.get("architectures") or []
    if architectures:
        return str(architectures[0])
    model_type = cfg.get("model_type")
    if model_type in MODEL_TYPE_ARCHITECTURES:
        return MODEL_TYPE_ARCHITECTURES[model_type]
    if model_type is None:
        raise ModelLoadError(f"{where}: required field 'architectures' (or 'model_type') is "
                             f"missing", param="architectures")
    return str(model_type)


def text_config_of(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The language model's config: `cfg` itself for a text model; for a vision-language
    one its `text_config` (else its top level), naming the text architecture it runs as."""
    architecture = architecture_of(cfg, where)
    if architecture not in VISION_ARCHITECTURES:
        return cfg
    nested = cfg.get("text_config")
    text = dict(nested) if isinstance(nested, dict) else {
        k: v for k, v in cfg.items() if k not in ("vision_config", "architectures")}
    for key in _INHERITED:
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    model_type = text.get("model_type")
    for key, value in _TEXT_DEFAULTS.get(str(model_type), {}).items():
        text.setdefault(key, value)
    text["architectures"] = [_TEXT_MODEL_TYPES.get(str(model_type),
                                                   VISION_ARCHITECTURES[architecture])]
    return text


def sliding_window_of(architecture: str, cfg: dict[str, Any]) -> int | None:
    """The attention window a config sets, None for full attention."""
    window = cfg.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get(
            "use_sliding_window", False):
        return None
    return int(window) if window else None


# Architectures that interleave sliding-window layers with global ones and run the window in
# attention (services/worker/models/gemma.py, gpt_oss.py): their context is not capped to the
# window.
INTERLEAVED_WINDOW_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                    "GptOssForCausalLM")
# Architectures whose every layer slides over `sliding_window`, as transformers runs them; the
# worker applies the window in attention (and frees the blocks that fall behind it), so their
# context is not capped to the window either.
SLIDING_EVERY_LAYER_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM",
                                     "Phi3ForCausalLM")


def context_length(max_position_embeddings: int, sliding_window: int | None) -> int:
    """Longest context served. `sliding_window` is given for the models whose window the
    worker does not apply (Qwen2/3 with use_sliding_window): their attention is full, so the
    window caps the context (within it full and sliding attention agree)."""
    if sliding_window is not None:
        return min(max_position_embeddings, sliding_window)
    return max_position_embeddings


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def eos_token_ids(cfg: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """EOS ids: the config's and the generation config's, united, first seen first."""
    ids = _as_ids(cfg.get("eos_token_id")) + _as_ids((generation or {}).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def bos_token_id(cfg: dict[str, Any], generation: dict[str, Any] | None) -> int | None:
    """The BOS id: the config's, else the generation config's (None when neither has one)."""
    bos = cfg.get("bos_token_id")
    if bos is None:
        bos = (generation or {}).get("bos_token_id")
    ids = _as_ids(bos)
    return ids[0] if ids else None


def max_model_len_of(files: ModelFiles) -> int:
    """The context length a worker serves for this model (before any --max-model-len)."""
    cfg = text_config_of(files.config, files.where)
    if cfg.get("max_position_embeddings") is None:
        raise ModelLoadError(f"{files.where}: required field 'max_position_embeddings' is "
                             f"missing", param="max_position_embeddings")
    architecture = architecture_of(cfg, files.where)
    window = (None if architecture in INTERLEAVED_WINDOW_ARCHITECTURES
              or architecture in SLIDING_EVERY_LAYER_ARCHITECTURES
              else sliding_window_of(architecture, cfg))
    return context_length(int(cfg["max_position_embeddings"]), window)
