"""Settings of the tokenizer service (flags `--model ...`, environment `MESHSERVE_MODEL=...`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.services.tokenizer.encode_pool import MAX_CHARS_PER_TOKEN, PromptLimits
from meshserve.shared.config import ServiceConfig, option

DEFAULT_PORT = 50051


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig(ServiceConfig):
    """The tokenizer service: which model's tokenizer and chat template it serves."""

    port: int = option(DEFAULT_PORT, "port of the Tokenizer gRPC service (0: any free port)")
    model: str = option("default", "model folder, GGUF file or hub id whose tokenizer to serve "
                                   "('default': SmolLM2-135M-Instruct)")
    tokenizer: str | None = option(None, "tokenizer folder or GGUF file when it is not the "
                                         "model's own (unset: the model's)")
    served_model_name: str | None = option(None, "name clients use for the model "
                                                 "(unset: the --model value, or the default "
                                                 "model's own name)")
    max_model_len: int | None = option(None, "longest sequence (prompt + output) to report "
                                             "(unset: from the model's config)")
    chat_template: str | None = option(None, "chat template file or inline Jinja text replacing "
                                             "the model's own (unset: the model's)")
    tokenize_workers: int = option(2, "threads that render and encode large prompts, each "
                                      "with its own tokenizer copy; small prompts are "
                                      "tokenized on the event loop")
    large_prompt_chars: int = option(8192, "prompts of this many characters (text, or all "
                                           "message contents) or more are tokenized on the "
                                           "threads (about 4 ms of encoding inline)")
    max_connection_age_s: float | None = option(
        None, "close each client connection after this many seconds (calls in flight "
              "finish), so that gateways naming the replicas by DNS resolve the name again "
              "and find replicas added since (unset: never)")
    max_prompt_chars: int | None = option(
        None, "longer prompts fail at once with a 400 (unset: "
              f"{MAX_CHARS_PER_TOKEN} per token of the context length, a context-length "
              "error, not applied to requests that truncate their prompt)")

    def validate(self) -> None:
        super().validate()
        self.require(bool(self.model), "must not be empty", "model")
        self.require(self.max_model_len is None or self.max_model_len >= 1,
                     f"must be >= 1, got {self.max_model_len}", "max_model_len")
        self.require(self.served_model_name is None or bool(self.served_model_name),
                     "must not be empty when set", "served_model_name")
        self.require(self.tokenize_workers >= 1, f"must be >= 1, got {self.tokenize_workers}",
                     "tokenize_workers")
        self.require(self.large_prompt_chars >= 0,
                     f"must be >= 0, got {self.large_prompt_chars}", "large_prompt_chars")
        self.require(self.max_connection_age_s is None or self.max_connection_age_s > 0,
                     f"must be > 0, got {self.max_connection_age_s}", "max_connection_age_s")
        self.require(self.max_prompt_chars is None or self.max_prompt_chars >= 1,
                     f"must be >= 1, got {self.max_prompt_chars}", "max_prompt_chars")

    @property
    def prompt_limits(self) -> PromptLimits:
        """How prompts are tokenized and bounded (see encode_pool.py)."""
        return PromptLimits(workers=self.tokenize_workers,
                            large_prompt_chars=self.large_prompt_chars,
                            max_prompt_chars=self.max_prompt_chars)
