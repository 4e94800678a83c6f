"""`--speculative-config`: vLLM's JSON object for speculative decoding, parsed and checked.

Two methods are supported:
- `ngram` (prompt lookup): `{"method": "ngram", "num_speculative_tokens": 4,
  "prompt_lookup_max": 4, "prompt_lookup_min": 1}`;
- `draft_model`: `{"model": "<folder or .gguf>", "num_speculative_tokens": 3}` (the method
  is implied by `model`, or named `"method": "draft_model"`). The draft shares the target's
  tokenizer and vocabulary.

Keys vLLM accepts that change nothing here are taken and ignored only where ignoring them is
exact (see `_IGNORED`); any other key is refused by name, never silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshserve.shared.errors import ConfigError

METHODS = ("ngram", "draft_model")
# Keys of vLLM's speculative config that ask for nothing meshserve would do differently.
_IGNORED = frozenset({"disable_log_stats"})
_KNOWN = frozenset({"method", "model", "num_speculative_tokens", "prompt_lookup_max",
                    "prompt_lookup_min", "max_model_len", "draft_tensor_parallel_size"}) | _IGNORED
# More drafts per step than this only costs: every one beyond the accepted run is wasted work.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with and how far ahead."""

    method: str  # ngram | draft_model
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: longest suffix matched in the context
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    model: str | None = None  # draft_model: its folder or .gguf file

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"--speculative-config: {message}",
                                  param="speculative_config")

        check(self.method in METHODS,
              f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        check(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got "
              f"{self.num_speculative_tokens}")
        check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        check((self.model is not None) == (self.method == "draft_model"),
              "a draft model (\"model\") goes with method draft_model, and only with it")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The SpeculativeConfig of vLLM's JSON text; ConfigError naming what is wrong."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ConfigError(f"--speculative-config must be a JSON object, got {text!r}",
                          param="speculative_config") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {text!r}",
                          param="speculative_config")
    unknown = sorted(set(value) - _KNOWN)
    if unknown:
        raise ConfigError(f"--speculative-config: keys not supported by meshserve: "
                          f"{', '.join(unknown)} (supported: {', '.join(sorted(_KNOWN))})",
                          param="speculative_config")
    if value.get("draft_tensor_parallel_size", 1) != 1:
        # vLLM's other choice, the target's size, is not offered: the draft is whole on rank 0.
        raise ConfigError("--speculative-config: draft_tensor_parallel_size must be 1 (the "
                          "draft model runs whole on one rank), got "
                          f"{value['draft_tensor_parallel_size']!r}", param="speculative_config")
    model = value.get("model")
    method = value.get("method") or ("draft_model" if model else None)
    if method is None:
        raise ConfigError("--speculative-config needs \"method\" (ngram) or \"model\" (a draft "
                          "model)", param="speculative_config")
    if "num_speculative_tokens" not in value:
        raise ConfigError("--speculative-config needs \"num_speculative_tokens\"",
                          param="speculative_config")
    lookup_max = _int(value, "prompt_lookup_max", None)
    lookup_min = _int(value, "prompt_lookup_min", None)
    # Unset bounds: suffixes of 1 to 4 tokens (a min above 4 alone raises the max to it).
    if lookup_min is None:
        lookup_min = 1
    if lookup_max is None:
        lookup_max = max(4, lookup_min)
    return SpeculativeConfig(
        method=str(method), num_speculative_tokens=_int(value, "num_speculative_tokens", 0),
        prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min,
        model=None if model is None else str(model))


def _int(value: dict[str, Any], key: str, default: int | None) -> Any:
    got = value.get(key, default)
    if got is not None and (isinstance(got, bool) or not isinstance(got, int)):
        raise ConfigError(f"--speculative-config: {key} must be an integer, got {got!r}",
                          param="speculative_config")
    return got
