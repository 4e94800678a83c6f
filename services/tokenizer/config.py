"""Settings of the tokenizer service (flags `--model ...`, environment `MESHSERVE_MODEL=...`)."""

from __future__ import annotations

from dataclasses import dataclass

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

    def validate(self) -> None:
        super().validate()
        self.require(bool(self.model), "must not be empty", "model")
        self.require(self.max_model_len is None or self.max_model_len >= 1,
                     f"must be >= 1, got {self.max_model_len}", "max_model_len")
        self.require(self.served_model_name is None or bool(self.served_model_name),
                     "must not be empty when set", "served_model_name")
