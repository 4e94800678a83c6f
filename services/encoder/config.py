"""Settings of the encoder service (flags `--model ...`, environment `MESHSERVE_MODEL=...`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshserve.shared.config import ServiceConfig, option

DEFAULT_PORT = 50056


@dataclass(frozen=True, kw_only=True)
class EncoderConfig(ServiceConfig):
    """The encoder service: which vision-language model's vision half it runs, and where."""

    port: int = option(DEFAULT_PORT, "port of the Encoder gRPC service (0: any free port)")
    model: str = option("", "vision-language model folder whose vision half to run")
    served_model_name: str | None = option(None, "name the workers use for the model "
                                                 "(unset: the --model value)")
    device: str = option("auto", "auto (the first GPU, else the CPU), cpu, cuda or cuda:N")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", "weights' type (auto: the checkpoint's on a GPU, float32 on the CPU)")
    load_format: Literal["auto", "dummy"] = option(
        "auto", "dummy: random weights of the right shapes (benchmarks)")
    shm_dir: str = option("/dev/shm", "where same-host answers are written (shared memory)")
    shm_ttl_s: float = option(60.0, "seconds after which an answer file nobody read is "
                                    "deleted")
    max_images_per_call: int = option(64, "most images one Encode call may carry")
    max_connection_age_s: float | None = option(
        None, "close each client connection after this many seconds (calls in flight "
              "finish), so that workers naming the replicas by DNS resolve the name again "
              "and find replicas added since (unset: never)")

    def validate(self) -> None:
        super().validate()
        self.require(bool(self.model), "is required (a vision-language model folder)", "model")
        self.require(self.shm_ttl_s > 0, f"must be > 0, got {self.shm_ttl_s}", "shm_ttl_s")
        self.require(self.max_images_per_call >= 1,
                     f"must be >= 1, got {self.max_images_per_call}", "max_images_per_call")
        self.require(self.max_connection_age_s is None or self.max_connection_age_s > 0,
                     f"must be > 0, got {self.max_connection_age_s}", "max_connection_age_s")
