"""`vllm serve` command lines on `meshserve serve` / `meshserve up`: vLLM's spelling of every
option meshserve has under another name, `--config FILE.yaml`, and a clear refusal of the
vLLM options meshserve does not support (never a silent no-op).

    argv = translate(["Qwen/Qwen3-8B", "--config", "serve.yaml", "-tp", "2",
                      "--data-parallel-size", "2"])
    # -> ["Qwen/Qwen3-8B", <the file's flags>, "--tensor-parallel-size", "2", "--workers", "2"]

Options with the same name in both (--max-model-len, --gpu-memory-utilization, --port, ...)
pass through untouched; `4k`-style sizes are read by the config parser itself
(shared/config.py). Flags after --config override the file's values, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from meshserve.shared.errors import ConfigError


def _task(value: str) -> list[str]:
    """vLLM's older --task: generate, or embed (a pooling runner converting the causal LM)."""
    if value in ("auto", "generate"):
        return []
    if value == "embed":
        return ["--runner", "pooling", "--convert", "embed"]
    raise _refuse("--task", value)


# vLLM name -> how it reads in meshserve: a flag name (the value follows), or a function of
# the value giving the flags.
_RENAMED: dict[str, str | Callable[[str], list[str]]] = {
    "--data-parallel-size": "--workers",
    "-dp": "--workers",
    "-tp": "--tensor-parallel-size",
    "--kv-cache-memory-bytes": "--kv-cache-memory",
    "--uvicorn-log-level": lambda v: ["--log-level", v.upper()],
    "--structured-outputs-config": lambda v: ["--structured-outputs-backend",
                                              _json_field(v, "backend", "xgrammar")],
    "--guided-decoding-backend": lambda v: ["--structured-outputs-backend",
                                            "xgrammar" if v in ("auto", "xgrammar") else v],
    "--task": _task,
}
# vLLM switches (no value) and their meshserve flags ([] : accepted, nothing to do).
_SWITCHES: dict[str, list[str]] = {
    "--disable-uvicorn-access-log": ["--no-access-log"],
    "--disable-log-requests": [],  # meshserve never logs request contents
    "--enable-log-requests": ["--access-log"],
    "--disable-log-stats": [],  # statistics are in /metrics, not logged
    "-ep": ["--enable-expert-parallel"],  # (the long name is meshserve's too)
}
# vLLM options meshserve does not support, and the values that ask for nothing.
_UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "--pipeline-parallel-size": ("1",), "-pp": ("1",),
    "--cpu-offload-gb": ("0",), "--swap-space": (),
    "--limit-mm-per-prompt": (), "--distributed-executor-backend": (),
    "--hf-overrides": (), "--rope-scaling": (), "--max-seq-len-to-capture": (),
    "--chat-template": (), "--response-role": ("assistant",), "--ssl-keyfile": (),
    "--ssl-certfile": (), "--middleware": (), "--lora-dtype": ("auto",), "--revision": (),
    "--tokenizer": (),  # the model's own tokenizer is always used
}
# vLLM options meshserve reads under the same name for some of vLLM's values only.
_PARTLY_SUPPORTED: dict[str, tuple[str, ...]] = {
    "--quantization": ("fp8",),
    "--kv-cache-dtype": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
}
_UNSUPPORTED_SWITCHES = ("--trust-remote-code", "--enable-prompt-tokens-details",
                         "--enable-sleep-mode")


def _json_field(text: str, key: str, default: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        raise ConfigError(f"--structured-outputs-config must be JSON, got {text!r}",
                          param="structured_outputs_config") from None
    return str(value.get(key, default)) if isinstance(value, dict) else default


def _refuse(flag: str, value: str | None = None) -> ConfigError:
    shown = flag if value is None else f"{flag} {value}"
    return ConfigError(f"{shown}: this vLLM option is not supported by meshserve "
                       "(docs/behaviour.md, 'Coming from vLLM')", param=flag.lstrip("-"))


def translate(argv: Sequence[str]) -> list[str]:
    """`argv` with --config expanded and vLLM's spellings turned into meshserve's."""
    out: list[str] = []
    args = _split_equals(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        value = args[i + 1] if i + 1 < len(args) else None
        if arg == "--config":
            if value is None:
                raise ConfigError("--config needs a YAML file", param="config")
            out = config_flags(Path(value)) + out
            i += 2
        elif arg == "--lora-modules":
            values = []
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            if not values:
                raise ConfigError("--lora-modules needs a value", param="lora-modules")
            out += ["--lora-modules", _lora_modules(values)]
        elif arg in _SWITCHES:
            out += _SWITCHES[arg]
            i += 1
        elif arg in _UNSUPPORTED_SWITCHES:
            raise _refuse(arg)
        elif arg in _PARTLY_SUPPORTED or arg == "-q":
            flag = "--quantization" if arg == "-q" else arg
            if value not in _PARTLY_SUPPORTED[flag]:
                raise ConfigError(f"{arg} {value}: this value is not supported by meshserve "
                                  f"(supported: {', '.join(_PARTLY_SUPPORTED[flag])})",
                                  param=flag.lstrip("-"))
            out += [flag, value]
            i += 2
        elif arg in _UNSUPPORTED or arg in _RENAMED:
            if value is None:
                raise ConfigError(f"{arg} needs a value", param=arg.lstrip("-"))
            if arg in _UNSUPPORTED and value not in _UNSUPPORTED[arg]:
                raise _refuse(arg, value)
            rename = _RENAMED.get(arg)
            out += [] if rename is None else (
                [rename, value] if isinstance(rename, str) else rename(value))
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def _lora_modules(values: list[str]) -> str:
    """vLLM's `--lora-modules a=PATH '{"name": ..}' ...` (several values) as meshserve's one
    value: comma-separated name=path, or a JSON array when any value is JSON."""
    if not any(v.lstrip().startswith(("{", "[")) for v in values):
        return ",".join(values)
    items: list[Any] = []
    for value in values:
        if not value.lstrip().startswith(("{", "[")):
            items.append(value)
            continue
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ConfigError(f"--lora-modules: invalid JSON {value!r}",
                              param="lora-modules") from None
        items.extend(parsed if isinstance(parsed, list) else [parsed])
    return json.dumps(items)


def _split_equals(argv: Sequence[str]) -> list[str]:
    """`--flag=value` as `--flag value` for the options this module reads."""
    known = {*_RENAMED, *_UNSUPPORTED, *_PARTLY_SUPPORTED, "-q", "--config", "--lora-modules"}
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        out += [flag, value] if eq and flag in known else [arg]
    return out


def config_flags(path: Path) -> list[str]:
    """The flags a vLLM-style YAML config file stands for (keys are option names, with
    dashes or underscores)."""
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {exc}", param="config") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of options",
                          param="config")
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        flags += _flag_tokens(flag, value)
    return translate(flags)


def _flag_tokens(flag: str, value: Any) -> list[str]:
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + flag[2:]]
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return [flag, json.dumps(value)]  # vLLM's JSON --lora-modules entries
    if isinstance(value, list):
        return [flag, ",".join(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
