"""The worker's configuration: the engine's options plus how the worker joins the mesh.

`EngineOptions` holds one field per `EngineConfig` field (with help text, as flags
`--max-num-seqs` and variables `MESHSERVE_MAX_NUM_SEQS`) and builds the
EngineConfig from them by EngineConfig's own field names, so a field added to the
engine without a flag here fails at import, not silently. `run-batch` and
`meshserve up` reuse these options; `WorkerConfig` adds the service's settings.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from typing import Literal

from meshserve.services.worker.engine.config import EngineConfig, GiB
from meshserve.services.worker.runner_config import RunnerOptions
from meshserve.shared.config import Config, ServiceConfig, option
from meshserve.shared.errors import ConfigError, InvalidRequestError


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions(Config):
    """How the model replica runs (every EngineConfig field, as flags and environment)."""

    model: str | None = option(None, "model folder, .gguf file or hub id (unset: the default "
                                     "model, SmolLM2-135M-Instruct)")
    load_format: Literal["auto", "hf", "gguf", "dummy"] = option(
        "auto", "weights format; dummy: random weights of the model's shape")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", "weights and KV dtype (auto: the model's, float32 on CPU)")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    seed: int = option(0, "seed of the engine's random state")
    max_model_len: int | None = option(None, "cap on prompt + output tokens (unset: the "
                                             "model's context length)")
    block_size: int = option(16, "tokens per KV block (8, 16, 32, 64 or 128)")
    kv_cache_memory: int = option(4 * GiB, "bytes of KV cache on CPU")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory this worker may use")
    num_kv_blocks: int | None = option(None, "fixed number of KV blocks (overrides sizing)")
    max_num_batched_tokens: int | None = option(None, "token budget of one engine step "
                                                      "(unset: 8192 on a GPU, 2048 on a CPU, "
                                                      "or at least the context length "
                                                      "without chunked prefill)")
    max_num_seqs: int | None = option(None, "most sequences running at once (unset: 1024 on "
                                            "a GPU of 70 GiB or more other than an A100, "
                                            "else 256)")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    long_prefill_token_threshold: int | None = option(
        None, "most prompt tokens one request prefills in a step that also decodes others, so "
              "that a long prompt does not stall them (unset: 2048 on a GPU, 256 on a CPU; "
              "0: no cap)")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    scheduling_policy: Literal["fcfs", "priority"] = option("fcfs", "local queue order")
    enforce_eager: bool = option(False, "never capture CUDA graphs")
    async_scheduling: Literal["auto", "on", "off"] = option(
        "auto", "overlap the CPU's work for the next step with the device's current step "
                "(auto: on a GPU)")
    structured_outputs_backend: Literal["xgrammar", "none"] = option(
        "xgrammar", "what compiles the grammars of structured outputs (response_format, "
                    "structured_outputs, guided_*; none: such requests are refused)")
    tensor_parallel_size: int = option(
        1, "devices one model replica is split over (-tp; one process per device, NCCL on "
           "GPUs, gloo on CPUs); on a GPU, ranks use the devices from --device's index on")
    disable_custom_all_reduce: bool = option(
        False, "sum small tensors over tensor-parallel GPU ranks with NCCL instead of the "
               "one-shot all-reduce over symmetric memory (NVLink)")
    quantization: Literal["fp8"] | None = option(
        None, "fp8: the decoder's linear layers in FP8 (e4m3, per-channel scales, activations "
              "quantized per token), quantized at load; FP8 checkpoints (fp8, "
              "compressed-tensors) are detected without it. GGUF files are dequantized to "
              "--dtype on load (a Q4 file takes the dtype's full size) unless this is set")
    quantize_lm_head: bool = option(
        False, "with FP8 weights (--quantization fp8 or an FP8 checkpoint), the LM head in "
               "FP8 too (per-row scales over the vocabulary): half its bytes read per token, "
               "logprobs a little further from the unquantized model's "
               "(docs/quantization.md); off, it stays in --dtype as vLLM keeps it")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = option(
        "auto", "KV cache element type: auto (the model's dtype) or FP8 (fp8 = fp8_e4m3; "
                "scale 1.0), which holds twice the tokens in the same memory")
    enable_lora: bool = option(False, "serve LoRA adapters (docs/lora.md)")
    max_loras: int = option(1, "LoRA adapters in device memory at once (and in one step)")
    max_lora_rank: int = option(16, "largest LoRA rank accepted (1, 8, 16, 32, 64, 128, 256, "
                                    "320 or 512); device slots are this wide")
    max_cpu_loras: int | None = option(None, "LoRA adapters kept in host memory (unset: "
                                             "--max-loras); others are read again when needed")
    lora_modules: str | None = option(
        None, "LoRA adapters to serve: comma-separated name=path, or vLLM's JSON "
              "'{\"name\": .., \"path\": .., \"base_model_name\": ..}' (or an array of them)")
    speculative_config: str | None = option(
        None, "speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (prompt lookup) or "
              "'{\"model\": \"<draft folder>\", \"num_speculative_tokens\": 3}' (a draft "
              "model of the same vocabulary); see docs/speculative.md")
    generation_config: str = option(
        "auto", "sampling defaults for fields a request leaves out: auto (the model's "
                "generation_config.json, as vLLM), vllm (none), or a folder holding one")
    override_generation_config: str | None = option(
        None, "JSON object of sampling defaults that win over the generation config, e.g. "
              "'{\"temperature\": 0.5}'")
    step_trace: str | None = option(
        None, "diagnostics: record every engine step (time, duration, running and waiting "
              "sequences, requests added, tokens; on a GPU also the device's own time: work, "
              "idle gaps, KV tier gathers) and write them as JSON lines to this file (a worker "
              "adds its id to the name) when the engine stops")
    num_threads: int | None = option(None, "CPU threads for torch (unset: torch's default); "
                                           "`meshserve up` gives each worker a share of the cores")

    def validate(self) -> None:
        super().validate()
        self.require(self.num_threads is None or self.num_threads > 0,
                     f"must be positive, got {self.num_threads}", "num_threads")
        try:
            self.engine_config()
        except InvalidRequestError as exc:  # EngineConfig's own checks, as a config error
            raise ConfigError(f"{type(self).__name__}.{exc.param}: {exc.message}",
                              param=exc.param) from None

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these options describe."""
        return EngineConfig(**{name: getattr(self, name) for name in _ENGINE_FIELDS})

    def engine_flags(self, *, only_changed: bool = True) -> list[str]:
        """These engine options as command-line flags (those differing from the defaults).

        Used to hand the same engine settings to worker processes.
        """
        flags: list[str] = []
        for f in dataclasses.fields(EngineOptions):
            value = getattr(self, f.name)
            if only_changed and value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
            else:
                flags += [flag, "" if value is None else str(value)]
        return flags


def short_flags(argv: Sequence[str]) -> list[str]:
    """vLLM's short spellings that the worker's command line also takes (-tp N, -tp=N)."""
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag == "-tp":
            out += ["--tensor-parallel-size", *([value] if eq else [])]
        else:
            out.append(arg)
    return out


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_missing = sorted(set(_ENGINE_FIELDS) - {f.name for f in dataclasses.fields(EngineOptions)})
assert not _missing, f"EngineOptions lacks EngineConfig fields: {_missing}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerConfig(RunnerOptions, EngineOptions, ServiceConfig):
    """One worker: a model replica served as the gRPC Worker service (generating, or
    pooling under --runner pooling)."""

    port: int = option(50053, "port of the Worker gRPC service (0: any free port)")
    worker_id: str | None = option(None, "unique, stable id of this worker (unset: "
                                         "hostname-port)")
    served_model_names: tuple[str, ...] = option(
        (), "comma-separated names the model is served under (unset: the model argument)")
    scheduler_address: str | None = option("127.0.0.1:50052", "host:port of the scheduler to "
                                                              "register with (empty: none)")
    redis_url: str | None = option("redis://127.0.0.1:6379/0", "Redis holding the KV block "
                                                               "index (empty: no KV events)")
    advertise_address: str | None = option(None, "host:port the scheduler hands to clients "
                                                  "(unset: the listen host, or this host's IP "
                                                  "when listening on all interfaces)")
    heartbeat_interval_s: float | None = option(None, "seconds between heartbeats (unset: "
                                                      "what the scheduler asks for)")
    kvstore_address: str | None = option(None, "host:port of the kvstore, the shared KV tier "
                                               "(empty: none)")
    kv_offload: bool = option(True, "with a kvstore: save computed KV blocks to it and load "
                                    "prompt blocks it holds instead of recomputing them")
    kv_offload_backlog_bytes: int = option(1 << 30, "most bytes of KV blocks waiting to be "
                                                    "saved; further saves are dropped")
    kvstore_shm: bool = option(True, "use the kvstore's shared memory when it runs on this "
                                     "host (else gRPC bytes)")

    def validate(self) -> None:
        super().validate()
        self.require(self.heartbeat_interval_s is None or self.heartbeat_interval_s > 0,
                     f"must be positive, got {self.heartbeat_interval_s}", "heartbeat_interval_s")
        self.require(self.worker_id is None or bool(self.worker_id.strip()),
                     "must not be blank", "worker_id")
        self.require(self.kv_offload_backlog_bytes > 0,
                     f"must be positive, got {self.kv_offload_backlog_bytes}",
                     "kv_offload_backlog_bytes")
        self.require(not (self.pooling and self.tensor_parallel_size > 1),
                     "a pooling worker runs on one device", "tensor_parallel_size")
        self.require(not (self.kvstore_address and self.kv_offload)
                     or self.enable_prefix_caching,
                     "the KV tier finds blocks by hash: it needs prefix caching",
                     "kv_offload")

    def resolved_worker_id(self, bound_port: int) -> str:
        """The configured worker id, or `<hostname>-<port>` (stable across restarts)."""
        return self.worker_id or f"{socket.gethostname()}-{bound_port}"

    def resolved_advertise_address(self, bound_port: int) -> str:
        """Where clients reach this worker: the configured address, else the listen host,
        else (listening on all interfaces) this host's IP address, which works in a
        container or pod whose hostname other hosts cannot resolve."""
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = socket.gethostname()
        return f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"

    def model_names(self, source_name: str) -> list[str]:
        """Names the model is served under, canonical first."""
        return list(self.served_model_names) or [source_name]
