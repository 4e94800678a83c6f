"""LoRA adapters as the mesh names them: PEFT adapter configs, stable ids, `--lora-modules`.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors). Every service
knows it by name; the id that keys its KV blocks (shared/block_hash.py) and routes its
requests is `lora_id_for(name)`, a hash of the name, so gateways, scheduler and workers agree
on it without asking one another.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from meshserve.shared.errors import InvalidRequestError, NotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Projections a Llama-family decoder layer can adapt.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TARGET_ALIASES = {"all-linear": TARGET_MODULES}


def lora_id_for(name: str) -> int:
    """The adapter's id mesh-wide: 31 bits of SHA-256 of its name, never 0."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") & 0x7FFFFFFF
    return digest or 1


@dataclass(frozen=True)
class LoraModule:
    """An adapter to serve: its name, folder and the base model it adapts (None: the
    worker's model)."""

    name: str
    path: str
    base_model_name: str | None = None

    @property
    def lora_id(self) -> int:
        return lora_id_for(self.name)


def parse_lora_modules(text: str | None) -> tuple[LoraModule, ...]:
    """The `--lora-modules` value: comma-separated `name=path`, or JSON: one vLLM object
    `{"name": .., "path": .., "base_model_name": ..}` or an array of such objects and
    `name=path` strings. Names must be unique."""
    text = (text or "").strip()
    if not text:
        return ()
    if text[0] in "[{":
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"--lora-modules: invalid JSON {text!r}: {exc}",
                                      param="lora_modules") from exc
        items = body if isinstance(body, list) else [body]
        modules = tuple(_module(item) for item in items)
    else:
        modules = tuple(_module(part.strip()) for part in text.split(",") if part.strip())
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"--lora-modules names the same adapter twice: {names}",
                                  param="lora_modules")
    return modules


def _module(item: object) -> LoraModule:
    if isinstance(item, dict):
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequestError("--lora-modules JSON needs string 'name' and 'path', got "
                                      f"{item!r}", param="lora_modules")
        return LoraModule(name, path, base if isinstance(base, str) else None)
    name, sep, path = str(item).partition("=")
    if not sep or not name or not path:
        raise InvalidRequestError(f"--lora-modules takes name=path or JSON, got {item!r}",
                                  param="lora_modules")
    return LoraModule(name, path)


@dataclass(frozen=True)
class LoraConfig:
    """What the engine needs of a PEFT adapter_config.json."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # subset of TARGET_MODULES
    use_rslora: bool = False
    base_model_name_or_path: str | None = None

    @property
    def scaling(self) -> float:
        """The factor on B @ A: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_lora_config(folder: str | Path) -> LoraConfig:
    """Parse `folder`/adapter_config.json. NotFoundError if the folder or file is missing;
    InvalidRequestError naming the field for what the engine cannot run (DoRA, extra trained
    modules, embedding or unknown targets, per-module ranks)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise NotFoundError(f"no LoRA adapter at {str(folder)!r} ({CONFIG_FILE} not found)",
                            param="lora_path")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc}", param="lora_path") from exc
    return lora_config_from_dict(raw)


def lora_config_from_dict(raw: dict[str, object]) -> LoraConfig:
    """The checks of `read_lora_config` on an already parsed adapter_config.json."""
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {raw.get('peft_type')!r} (only LORA)")
    if raw.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if raw.get("modules_to_save"):
        raise refuse(f"modules_to_save {raw['modules_to_save']!r} (fully trained modules)")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise refuse("per-module ranks or alphas (rank_pattern, alpha_pattern)")
    if raw.get("bias", "none") not in ("none", None):
        raise refuse(f"bias {raw['bias']!r} (only 'none')")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    targets = _targets(raw.get("target_modules"))
    base = raw.get("base_model_name_or_path")
    return LoraConfig(rank=rank, alpha=float(alpha), target_modules=targets,
                      use_rslora=bool(raw.get("use_rslora", False)),
                      base_model_name_or_path=base if isinstance(base, str) else None)


def refuse(message: str) -> InvalidRequestError:
    """The error for an adapter the engine cannot run."""
    return InvalidRequestError(f"unsupported LoRA adapter: {message}", param="lora_path")


def _targets(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        names = _TARGET_ALIASES.get(value)
        if names is None:
            raise refuse(f"target_modules pattern {value!r} (list the modules instead)")
        return names
    if not isinstance(value, list) or not value:
        raise refuse(f"target_modules must be a non-empty list, got {value!r}")
    unknown = [v for v in value if v not in TARGET_MODULES]
    if unknown:
        raise refuse(f"target_modules {unknown!r} (supported: {', '.join(TARGET_MODULES)})")
    return tuple(m for m in TARGET_MODULES if m in value)
