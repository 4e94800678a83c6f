"""How a pooling worker turns hidden states into embeddings, read as vLLM reads it.

Three sources, strongest first:
1. `--pooler-config` JSON (`{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true,
   "dimensions": N}`); a key it does not know is an error, never silently dropped.
2. The model folder's sentence-transformers files: `modules.json` names a
   `sentence_transformers.models.Pooling` module whose `config.json` (e.g.
   `1_Pooling/config.json`) sets one `pooling_mode_*` flag (lasttoken -> LAST,
   mean_tokens -> MEAN, cls_token -> CLS); normalisation is on exactly when `modules.json`
   lists a `sentence_transformers.models.Normalize` module.
3. Defaults for a causal decoder run as an embedder: LAST token, normalised.

Matryoshka (shorter vectors on request): allowed when config.json sets `is_matryoshka`
or lists `matryoshka_dimensions` (then only those lengths are allowed), as vLLM reads
them. Pure logic: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

from meshserve.shared.errors import ConfigError, InvalidRequestError, ModelLoadError

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = ("LAST", "MEAN", "CLS")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling_mode_* flags -> our pooling types (others are refused).
_ST_MODES: dict[str, PoolingType] = {"lasttoken": "LAST", "mean_tokens": "MEAN",
                                     "cls_token": "CLS"}
_OVERRIDE_KEYS = ("pooling_type", "normalize", "dimensions")


@dataclass(frozen=True)
class PoolerConfig:
    """The resolved pooling of one model. `source` says where it came from (logs, docs)."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    default_dimensions: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"

    def resolve_dimensions(self, requested: int | None, model: str) -> int:
        """The vector length of a request asking for `requested` dimensions (None: the
        default); InvalidRequestError (param `dimensions`) when the model does not allow it."""
        if requested is None:
            return self.default_dimensions or self.hidden_size
        if requested < 1:
            raise InvalidRequestError(f"'dimensions' must be at least 1, got {requested}",
                                      param="dimensions")
        if not self.is_matryoshka:
            raise InvalidRequestError(
                f"Model \"{model}\" does not support matryoshka representation: 'dimensions' "
                "cannot change the length of its embeddings", param="dimensions")
        allowed = self.matryoshka_dimensions
        if allowed is not None and requested not in allowed:
            raise InvalidRequestError(
                f"Model \"{model}\" only supports {list(allowed)} matryoshka dimensions, "
                f"got {requested}", param="dimensions")
        if requested > self.hidden_size:
            raise InvalidRequestError(
                f"'dimensions' ({requested}) is larger than the model's embedding size "
                f"({self.hidden_size})", param="dimensions")
        return requested


def parse_override(text: str | None) -> dict[str, Any]:
    """The `--pooler-config` JSON as a checked dict (empty for None or "");
    ConfigError naming the first bad key or value."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--pooler-config is not valid JSON: {exc}",
                          param="pooler_config") from None
    if not isinstance(value, dict):
        raise ConfigError("--pooler-config must be a JSON object", param="pooler_config")
    unknown = sorted(set(value) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ConfigError(f"--pooler-config: unsupported key(s) {unknown} (supported: "
                          f"{list(_OVERRIDE_KEYS)})", param="pooler_config")
    checked: dict[str, Any] = {}
    kind = value.get("pooling_type")
    if kind is not None:
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ConfigError(f"--pooler-config: pooling_type must be one of "
                              f"{list(POOLING_TYPES)}, got {kind!r}", param="pooler_config")
        checked["pooling_type"] = kind.upper()
    if value.get("normalize") is not None:
        if not isinstance(value["normalize"], bool):
            raise ConfigError("--pooler-config: normalize must be true or false",
                              param="pooler_config")
        checked["normalize"] = value["normalize"]
    dims = value.get("dimensions")
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise ConfigError(f"--pooler-config: dimensions must be a positive integer, got "
                              f"{dims!r}", param="pooler_config")
        checked["dimensions"] = dims
    return checked


def sentence_transformers_pooling(folder: Path | None) -> dict[str, Any] | None:
    """{"pooling_type", "normalize"} from a sentence-transformers folder, or None when the
    folder has no modules.json with a Pooling module."""
    if folder is None or not (folder / "modules.json").is_file():
        return None
    modules = _read(folder / "modules.json")
    if not isinstance(modules, list):
        raise ModelLoadError(f"{folder / 'modules.json'} is not a JSON array",
                             param="modules.json")
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING),
                   None)
    if pooling is None:
        return None
    path = folder / str(pooling.get("path", "")) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"modules.json names a Pooling module but {path} is missing",
                             param="modules.json")
    settings = _read(path)
    modes = [key.removeprefix("pooling_mode_") for key, on in settings.items()
             if key.startswith("pooling_mode_") and on is True]
    if not modes:
        return None
    if modes[0] not in _ST_MODES:
        raise ModelLoadError(f"{path}: pooling mode {modes[0]!r} is not supported (supported: "
                             f"{sorted(_ST_MODES)})", param="pooling_mode")
    normalize = any(isinstance(m, dict) and m.get("type") == _ST_NORMALIZE for m in modules)
    return {"pooling_type": _ST_MODES[modes[0]], "normalize": normalize}


def resolve_pooler_config(hf_config: Mapping[str, Any], hidden_size: int, folder: Path | None,
                          override: str | None) -> PoolerConfig:
    """The pooling of a model: `--pooler-config` over sentence-transformers files over the
    defaults (module doc), with the Matryoshka facts of its config.json."""
    settings: dict[str, Any] = {}
    source = "default"
    found = sentence_transformers_pooling(folder)
    if found is not None:
        settings.update(found)
        source = "sentence-transformers"
    forced = parse_override(override)
    if forced:
        settings.update(forced)
        source = "--pooler-config" if found is None else "--pooler-config over sentence-transformers"
    dims = hf_config.get("matryoshka_dimensions")
    matryoshka = tuple(int(d) for d in dims) if dims else None
    config = PoolerConfig(
        pooling_type=cast(PoolingType, settings.get("pooling_type", "LAST")),
        normalize=bool(settings.get("normalize", True)), hidden_size=hidden_size,
        is_matryoshka=bool(matryoshka) or bool(hf_config.get("is_matryoshka", False)),
        matryoshka_dimensions=matryoshka, source=source)
    if "dimensions" in settings:  # a default length must itself be an allowed one
        try:
            config.resolve_dimensions(settings["dimensions"], "this model")
        except InvalidRequestError as exc:
            raise ConfigError(f"--pooler-config: {exc.message}", param="pooler_config") from None
        config = replace(config, default_dimensions=settings["dimensions"])
    return config


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", param=path.name) from exc
