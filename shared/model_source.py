"""Where a model comes from: the default model, a folder, a .gguf file or a hub id.

Free of torch so that services which only need the tokenizer (the tokenizer
service, the gateway) can resolve a model without loading the model code.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

from meshserve.shared.default_model import DEFAULT_MODEL_NAME, default_model_path
from meshserve.shared.errors import ModelLoadError

LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from."""

    name: str  # what the user passed (the served model name)
    path: Path  # folder (hf) or the .gguf file
    format: str  # "hf" | "gguf" | "dummy"
    gguf_file: Path | None  # the .gguf holding the config (and weights unless dummy)


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Turn a model argument (None/"default", folder, .gguf file or hub id) into a source."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}",
                             param="load_format")
    if model is None or model == "default":
        gguf = default_model_path()
        source = ModelSource(DEFAULT_MODEL_NAME, gguf, "gguf", gguf)
    else:
        path = Path(model).expanduser().resolve()
        if path.is_dir():
            source = _folder_source(model, path)
        elif path.is_file():
            if path.suffix != ".gguf":
                raise ModelLoadError(f"model file {path} is not a .gguf file; pass a model "
                                     f"folder or a .gguf file", param="model")
            source = ModelSource(model, path, "gguf", path)
        else:
            source = _folder_source(model, _hub_snapshot(model))
    if load_format == "dummy":
        return replace(source, format="dummy")
    if load_format == "gguf" and source.format != "gguf":
        raise ModelLoadError(f"load_format 'gguf' needs a .gguf file, got {source.path}",
                             param="load_format")
    if load_format == "hf" and source.format != "hf":
        raise ModelLoadError(f"load_format 'hf' needs a Hugging Face model folder, got "
                             f"{source.path}", param="load_format")
    return source


def _folder_source(name: str, folder: Path) -> ModelSource:
    if (folder / "config.json").is_file():
        return ModelSource(name, folder, "hf", None)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(name, ggufs[0], "gguf", ggufs[0])
    if ggufs:
        raise ModelLoadError(f"{folder} holds several .gguf files "
                             f"({', '.join(g.name for g in ggufs)}); pass one of them",
                             param="model")
    raise ModelLoadError(f"{folder / 'config.json'} is missing: {folder} is not a Hugging Face "
                         f"model folder", param="config.json")


def _hub_snapshot(model: str) -> Path:
    """Download (or find in the local hub cache) a hub repository; fail fast when offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        raise ModelLoadError(f"model path {model!r} does not exist", param="model") from exc
    try:  # already in the hub cache: works offline
        return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except OSError:  # not cached (LocalEntryNotFoundError): go online, or fail below
        pass
    reason = _hub_unreachable_reason()
    if reason:
        raise ModelLoadError(f"model path {model!r} does not exist and no model hub is "
                             f"reachable ({reason})", param="model")
    try:
        return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # hub errors are many; all mean "cannot load"
        raise ModelLoadError(f"could not download {model!r} from the model hub: {exc}",
                             param="model") from exc


def _hub_unreachable_reason() -> str | None:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE=1"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return None  # reachable through the proxy, as far as we can tell cheaply
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or 443
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc}"
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_folder(source: ModelSource) -> Path | None:
    """The folder holding the model's Hugging Face tokenizer files, or None if it has none.

    A GGUF file carries its tokenizer: it is exported to a folder once and cached (the
    first call may take seconds)."""
    if source.gguf_file is not None:
        from meshserve.shared.gguf_export import exported_folder

        return exported_folder(source.gguf_file)
    folder = source.path if source.path.is_dir() else source.path.parent
    return folder if any((folder / f).is_file() for f in _TOKENIZER_FILES) else None
