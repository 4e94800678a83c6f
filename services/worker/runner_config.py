"""What a worker runs its model for, spelled as vLLM spells it.

    --runner auto|generate|pooling   (auto: generate; every architecture meshserve runs is
                                      a *ForCausalLM, which vLLM's auto also generates with)
    --convert auto|none|embed        (embed: run the causal LM as an embedder; auto: embed
                                      under --runner pooling; embed alone implies pooling)
    --pooler-config JSON             ({"pooling_type": "LAST"|"MEAN"|"CLS", "normalize":
                                      true, "dimensions": N}; see models/pooling_config.py)

Shared by the worker's and the launcher's configs, which hand these flags on to workers.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshserve.services.worker.models.pooling_config import parse_override
from meshserve.shared.config import Config, option
from meshserve.shared.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerOptions(Config):
    """Generation or pooling (embeddings), and how a pooling worker pools."""

    runner: Literal["auto", "generate", "pooling"] = option(
        "auto", "what the model runs for: generate (completions, chat) or pooling "
                "(/v1/embeddings); auto: generate")
    convert: Literal["auto", "none", "embed"] = option(
        "auto", "adapt the causal LM to a pooling task: embed (implies --runner pooling); "
                "auto: embed under --runner pooling")
    pooler_config: str | None = option(
        None, "pooling settings as JSON, over the model folder's sentence-transformers files: "
              '{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true, "dimensions": N}')

    def validate(self) -> None:
        super().validate()
        self.require(not (self.runner == "generate" and self.convert == "embed"),
                     "--convert embed runs the model as an embedder: it needs --runner "
                     "pooling (or auto), not generate", "convert")
        self.require(not (self.pooling and self.convert == "none"),
                     "no architecture meshserve runs pools natively (all are *ForCausalLM); "
                     "use --convert embed or auto with --runner pooling", "convert")
        self.require(self.pooling or not self.pooler_config,
                     "only a pooling worker pools: add --runner pooling", "pooler_config")
        # The engine options sit beside these in a worker's or launcher's config.
        self.require(not (self.pooling and getattr(self, "enable_lora", False)),
                     "LoRA adapters are served by generation workers only (drop --enable-lora "
                     "or --runner pooling)", "enable_lora")
        try:
            parse_override(self.pooler_config)
        except ConfigError as exc:
            raise ConfigError(f"{type(self).__name__}.pooler_config: {exc.message}",
                              param="pooler_config") from None

    @property
    def pooling(self) -> bool:
        """Whether the worker embeds instead of generating."""
        return self.runner == "pooling" or (self.runner == "auto" and self.convert == "embed")

    def runner_flags(self) -> list[str]:
        """These options as worker flags (those set away from their defaults)."""
        flags: list[str] = []
        if self.pooling:
            flags += ["--runner", "pooling"]
        if self.convert != "auto":
            flags += ["--convert", self.convert]
        if self.pooler_config:
            flags += ["--pooler-config", self.pooler_config]
        return flags
