"""A model's sampling defaults from its generation_config.json, as vLLM's
`--generation-config auto|vllm|FOLDER` and `--override-generation-config` read them.

    defaults = sampling_defaults(model_folder, "auto", '{"temperature": 0.5}')
    # {"temperature": 0.5, "top_p": 0.9, "max_tokens": 512}: used for fields a request omits

Workers announce these with their registration; the gateway fills the fields a request
body leaves out (max_tokens caps the default output length, as vLLM's max_new_tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshserve.shared.errors import ModelLoadError

# generation_config.json key -> request field.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_folder: Path | None, mode: str = "auto",
                      override: str | None = None) -> dict[str, Any]:
    """The request defaults: `mode` "auto" reads `model_folder`, "vllm" reads nothing, any
    other value is a folder holding generation_config.json; `override` (JSON) wins."""
    values: dict[str, Any] = {}
    folder = None if mode == "vllm" else (model_folder if mode == "auto" else Path(mode))
    if folder is not None and (folder / "generation_config.json").is_file():
        try:
            config = json.loads((folder / "generation_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {folder / 'generation_config.json'}: {exc}",
                                 param="generation_config") from exc
        values = {field: config[key] for key, field in _FIELDS.items()
                  if isinstance(config.get(key), (int, float)) and not isinstance(
                      config.get(key), bool)}
    elif mode not in ("auto", "vllm"):
        raise ModelLoadError(f"--generation-config {mode}: no generation_config.json there",
                             param="generation_config")
    if override:
        try:
            extra = json.loads(override)
        except ValueError as exc:
            raise ModelLoadError(f"--override-generation-config is not JSON: {exc}",
                                 param="override_generation_config") from None
        if not isinstance(extra, dict):
            raise ModelLoadError("--override-generation-config must be a JSON object",
                                 param="override_generation_config")
        fields: dict[str, Any] = extra  # a JSON object's keys are strings
        values.update({_FIELDS.get(key, key): value for key, value in fields.items()})
    return values


def apply_defaults(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`body` with each default it leaves out (max_tokens is handled by the caller)."""
    missing = {k: v for k, v in defaults.items() if k != "max_tokens" and body.get(k) is None}
    return {**body, **missing} if missing else body
