"""The one config pattern: a frozen dataclass per service, built from flags and environment.

A service declares its settings as fields made with `option()`:

    @dataclass(frozen=True, kw_only=True)
    class WorkerConfig(ServiceConfig):
        port: int = option(50053, "port of the Worker gRPC service")
        model: str = option("dummy", "model folder, GGUF file or hub id")

        def validate(self) -> None:
            super().validate()
            ...

        @property
        def some_derived_value(self) -> int: ...

and builds it with `WorkerConfig.from_args()`. Each field `foo_bar` is the flag
`--foo-bar` and the environment variable `MESHSERVE_FOO_BAR`; flags override the
environment, which overrides defaults. This module is the only place that reads
the environment. Unknown `MESHSERVE_*` variables and unknown keys are errors, and
every value is type-checked and validated on construction (ConfigError naming
the field and where its value came from).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from meshserve.shared.errors import ConfigError

ENV_PREFIX = "MESHSERVE_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
# Variables with the prefix that belong to no one service's config but to every process
# (the model cache folder; the launcher that started it): never "unknown".
PROCESS_WIDE_ENV = frozenset({"MESHSERVE_CACHE", "MESHSERVE_PARENT_PID"})


def option(default: Any, help: str, *, env: str | None = None) -> Any:
    """A config field with its help text; `env` names an extra variable read for it.

    `env` is for variables with a standard name (OTEL_EXPORTER_OTLP_ENDPOINT);
    `MESHSERVE_<FIELD>` is always read and wins over it.
    """
    if isinstance(default, (list, dict, set)):
        raise TypeError(f"config defaults must be immutable (use a tuple), got {default!r}")
    return dataclasses.field(default=default, metadata={"help": help, "env": env})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _optional_inner(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """An integer as vLLM reads sizes: `4k` = 4000, `4K` = 4096 (likewise m/M, g/G, t/T),
    `1.5k` = 1500 (a fraction only with a decimal suffix)."""
    text = text.strip()
    suffix = text[-1:] if text[-1:] in {**_DECIMAL, **_BINARY} else ""
    number = text[:-1] if suffix else text
    if not suffix:
        return int(number)
    if suffix in _BINARY:
        if not number.isdigit():
            raise ValueError(f"{text!r}: a binary suffix ({suffix}) takes a whole number")
        return int(number) * _BINARY[suffix]
    value = float(number) * _DECIMAL[suffix]
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def parse_value(text: str, tp: Any) -> Any:
    """Parse one flag or environment string as type `tp`; ValueError if it is not one."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if text == "" else parse_value(text, inner)
    origin = typing.get_origin(tp)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return tuple(parse_value(part.strip(), item) for part in text.split(",") if part.strip())
    if origin is Literal:
        for choice in typing.get_args(tp):
            if str(choice) == text:
                return choice
        raise ValueError(f"expected one of {list(typing.get_args(tp))}, got {text!r}")
    if tp is bool:
        lowered = text.strip().lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(text)
    if tp is int:
        return human_int(text)
    if tp in (float, str, Path):
        return tp(text)
    raise TypeError(f"config fields of type {_type_name(tp)} are not supported")


def check_value(value: Any, tp: Any) -> Any:
    """`value` as type `tp` (ints widen to float, lists become tuples); ValueError if not."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else check_value(value, inner)
    origin = typing.get_origin(tp)
    if origin is tuple and isinstance(value, (tuple, list)):
        return tuple(check_value(v, typing.get_args(tp)[0]) for v in value)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ValueError(f"expected one of {list(typing.get_args(tp))}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is Path and isinstance(value, str):
        return Path(value)
    is_instance = isinstance(tp, type) and isinstance(value, tp)
    if is_instance and not (tp is int and isinstance(value, bool)):
        return value
    raise ValueError(f"expected {_type_name(tp)}, got {value!r}")


class _RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of exiting on bad input (the
    message without the program's name: whoever prints it says which program it is), and
    never reads an abbreviation as a longer flag (`--tokenizer` is not `--tokenizers`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message, param="argv")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Base of every service config: typed, frozen, validated on construction."""

    env_prefix: ClassVar[str] = ENV_PREFIX

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                checked = check_value(value, hints[f.name])
            except ValueError as exc:
                raise ConfigError(f"{type(self).__name__}.{f.name}: {exc}", param=f.name) from None
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        self.validate()

    def validate(self) -> None:
        """Check relations between values; subclasses raise ConfigError naming the field."""

    def require(self, ok: bool, message: str, field: str) -> None:
        """Raise ConfigError(message) for `field` unless `ok` (for use in validate())."""
        if not ok:
            raise ConfigError(f"{type(self).__name__}.{field}: {message}", param=field)

    @classmethod
    def env_names(cls, field: dataclasses.Field[Any]) -> list[str]:
        """Environment variables read for `field`, strongest last."""
        alias = field.metadata.get("env")
        return ([alias] if alias else []) + [cls.env_prefix + field.name.upper()]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (`--field-name`, help from the field's metadata)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            help_text = f"{f.metadata.get('help', '')} (env {cls.env_names(f)[-1]}; " \
                        f"default: {f.default!r})"
            flag = "--" + f.name.replace("_", "-")
            if tp is bool:
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=argparse.SUPPRESS, help=help_text)
                continue
            # Flags arrive as strings: a Literal of ints (0, 1, 2) is offered as "0", "1", "2".
            choices = ([str(c) for c in typing.get_args(tp)]
                       if typing.get_origin(tp) is Literal else None)
            parser.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, help=help_text,
                                metavar=f.name.upper(), choices=choices)

    @classmethod
    def parser(cls, prog: str | None = None, description: str | None = None
               ) -> argparse.ArgumentParser:
        """An argument parser for this config that raises ConfigError on bad flags."""
        parser = _RaisingParser(prog=prog, description=description or cls.__doc__)
        cls.add_arguments(parser)
        return parser

    @classmethod
    def read_env(cls, environ: Mapping[str, str] | None = None, *, strict: bool = True
                 ) -> dict[str, str]:
        """Raw values from the environment, by field name.

        With `strict`, a `MESHSERVE_*` variable that names no field is an error; a
        launcher that shares one environment between several services passes False.
        """
        env = os.environ if environ is None else environ
        values: dict[str, str] = {}
        known: set[str] = set()
        for f in dataclasses.fields(cls):
            for name in cls.env_names(f):
                known.add(name)
                if name in env:
                    values[f.name] = env[name]
        unknown = sorted(k for k in env if k.startswith(cls.env_prefix)
                         and k not in known and k not in PROCESS_WIDE_ENV)
        if strict and unknown:
            raise ConfigError(f"unknown environment variables for {cls.__name__}: "
                              f"{', '.join(unknown)}", param=unknown[0])
        return values

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, *,
                  environ: Mapping[str, str] | None = None, strict_env: bool = True,
                  prog: str | None = None) -> Self:
        """Build from flags (`argv`, default sys.argv[1:]) over the environment."""
        flags = vars(cls.parser(prog).parse_args(argv))
        env = cls.read_env(environ, strict=strict_env)
        values: dict[str, Any] = {}
        for name, raw in env.items():
            values[name] = cls._parse_field(name, raw, "environment")
        for name, raw in flags.items():
            values[name] = cls._parse_field(name, raw, "flag --" + name.replace("_", "-"))
        return cls(**values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        """Build from a mapping (a parsed file, a test); strings are parsed like flags."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown keys for {cls.__name__}: {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(names))})", param=unknown[0])
        return cls(**{k: cls._parse_field(k, v, "mapping") if isinstance(v, str) else v
                      for k, v in values.items()})

    @classmethod
    def _parse_field(cls, name: str, raw: Any, source: str) -> Any:
        if not isinstance(raw, str):
            return raw
        try:
            return parse_value(raw, typing.get_type_hints(cls)[name])
        except ValueError as exc:
            raise ConfigError(f"{cls.__name__}.{name} from {source}: {exc}", param=name) from None

    def as_dict(self) -> dict[str, Any]:
        """Field values by name (for logs and tests)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig(Config):
    """Settings every meshserve service has; a service's config subclasses it."""

    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = option(50051, "port to listen on (0: any free port)")
    metrics_port: int | None = option(None, "port of the Prometheus /metrics endpoint "
                                            "(unset: none)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option("INFO", "log level")
    log_format: Literal["json", "text"] = option("json", "log record format")
    otlp_endpoint: str | None = option(None, "OTLP gRPC endpoint for traces (unset: no export)",
                                       env="OTEL_EXPORTER_OTLP_ENDPOINT")
    drain_grace_s: float = option(30.0, "seconds in-flight calls may take to finish on SIGTERM")
    reuse_port: bool = option(False, "listen with SO_REUSEPORT, so that replicas on one host "
                                     "share the port (and the metrics port)")

    def validate(self) -> None:
        self.require(0 <= self.port <= 65535, f"must be in [0, 65535], got {self.port}", "port")
        self.require(self.metrics_port is None or 0 <= self.metrics_port <= 65535,
                     f"must be in [0, 65535], got {self.metrics_port}", "metrics_port")
        self.require(self.drain_grace_s >= 0, f"must be >= 0, got {self.drain_grace_s}",
                     "drain_grace_s")
        self.require(bool(self.host), "must not be empty", "host")

    @property
    def listen_address(self) -> str:
        """host:port for grpc.aio's add_insecure_port (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
