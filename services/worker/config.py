"""The worker's configuration: the engine's config plus how the worker joins the mesh.

`EngineConfig` is the one configuration of a model replica: every field is a flag
(`--max-num-seqs`) and an environment variable (`MESHSERVE_MAX_NUM_SEQS`), each default
is written here once, and every check raises ConfigError naming the field. The engine,
`run-batch`, `meshserve bench` and `meshserve up` (which hands the changed fields on to
its workers as flags) all take it; `WorkerConfig` adds the service's settings. The kernel
knobs (`pdl`, `fp8_widen`, `tp_fused_norm`) are engine fields too, so that every worker
process, tensor-parallel followers included, gets them from its own config.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import Literal

from meshserve.kernels.knobs import KernelKnobs
from meshserve.services.worker.runner_config import RunnerOptions
from meshserve.shared.config import Config, ServiceConfig, option
from meshserve.shared.errors import ConfigError, InvalidRequestError
from meshserve.shared.lora_config import parse_lora_modules
from meshserve.shared.sampling_params import MAX_LOGPROBS
from meshserve.shared.speculative_config import SpeculativeConfig, parse_speculative_config

GiB = 1 << 30
# Most prompt tokens one request prefills in a step shared with decodes, when unset.
CPU_PREFILL_CHUNK_CAP = 256
GPU_PREFILL_CHUNK_CAP = 2048
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(Config):
    """How one model replica runs. `None` fields are derived from the model or the device."""

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
    mm_embedding_cache_memory: int = option(
        1 * GiB, "bytes of image embeddings kept by image hash (vision-language models)")
    mm_encoder_placement: Literal["auto", "worker", "encoder"] = option(
        "auto", "where images are encoded: auto (the encoder services of "
                "--encoder-addresses when given, the worker itself when they fail or none "
                "are given), worker (always itself), encoder (only the services)")
    encoder_addresses: str | None = option(
        None, "encoder services (host:port, comma-separated) for vision-language models")
    encoder_shared_memory: Literal["auto", "on", "off"] = option(
        "auto", "take image rows from encoder services through shared-memory files (auto: "
                "for loopback addresses; off where the two do not share /dev/shm, such as "
                "containers)")
    enable_prompt_embeds: bool = option(
        False, "take prompts given as embeddings (prompt_embeds on /v1/completions), whose "
               "rows replace the token embeddings (as vLLM; off: such prompts are refused)")
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
    enable_expert_parallel: bool = option(
        False, "mixtures of experts at --tensor-parallel-size N: place whole experts on the "
               "ranks (rank r holds experts r*E/N..(r+1)*E/N-1; N must divide E) instead of "
               "splitting every expert over all ranks; -ep, as in vLLM. Dense models ignore it")
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
    max_logprobs: int = option(
        MAX_LOGPROBS, "most logprobs a request may ask for per token (logprobs, "
                      "top_logprobs, prompt_logprobs); -1: the whole vocabulary, which is "
                      "also what a request's -1 asks for (as vLLM)")
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
    pdl: Literal[0, 1, 2] = option(
        2, "kernels: programmatic dependent launch on Hopper-class GPUs (0 off, 1 each kernel "
           "waits for the one before, 2 also lets the next one be dispatched early); "
           "elsewhere always off")
    fp8_widen: Literal["cvt", "bits"] = option(
        "cvt", "kernels: how FP8 e4m3 values widen to float16, by the conversion instruction "
               "(cvt) or by integer instructions (bits, also offered to the FP8 GEMM tuner)")
    tp_fused_norm: bool = option(
        True, "kernels: at tensor parallelism, sum over ranks, add the residual and RMS-norm "
              "in one kernel (off: the sum, then the norm)")

    @property
    def encoder_address_list(self) -> list[str]:
        """--encoder-addresses as a list (empty when unset)."""
        return [a.strip() for a in (self.encoder_addresses or "").split(",") if a.strip()]

    def validate(self) -> None:
        super().validate()
        require = self.require
        require(self.block_size in (8, 16, 32, 64, 128),
                f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}",
                "block_size")
        require(self.kv_cache_memory > 0, "--kv-cache-memory must be positive", "kv_cache_memory")
        require(self.mm_encoder_placement != "encoder" or bool(self.encoder_address_list),
                "--mm-encoder-placement encoder needs --encoder-addresses",
                "mm_encoder_placement")
        require(self.max_logprobs >= -1, "--max-logprobs must be -1 (the vocabulary) or "
                f"a count, got {self.max_logprobs}", "max_logprobs")
        require(0.0 < self.gpu_memory_utilization <= 1.0,
                "--gpu-memory-utilization must be in (0, 1]", "gpu_memory_utilization")
        for name in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "num_threads"):
            value = getattr(self, name)
            require(value is None or value > 0,
                    f"--{name.replace('_', '-')} must be positive, got {value}", name)
        require(self.long_prefill_token_threshold is None
                or self.long_prefill_token_threshold >= 0,
                "--long-prefill-token-threshold must be >= 0", "long_prefill_token_threshold")
        require(self.max_model_len is None or self.max_model_len > 1,
                "--max-model-len must be at least 2", "max_model_len")
        require(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be at least 1",
                "tensor_parallel_size")
        require(not self.enable_expert_parallel or self.tensor_parallel_size > 1,
                "--enable-expert-parallel places experts on the tensor-parallel ranks of one "
                "worker: it needs --tensor-parallel-size above 1 (replicas from --workers or "
                "--data-parallel-size do not share experts)", "enable_expert_parallel")
        require(not (self.enable_prompt_embeds and self.tensor_parallel_size > 1),
                "--enable-prompt-embeds runs on one device: the other tensor-parallel ranks "
                "are not sent the prompts' rows", "enable_prompt_embeds")
        self._validate_lora()
        self._validate_speculation()

    def _validate_lora(self) -> None:
        require = self.require
        require(self.max_loras > 0, "--max-loras must be positive", "max_loras")
        require(self.max_lora_rank in _LORA_RANKS,
                f"--max-lora-rank must be one of {', '.join(map(str, _LORA_RANKS))}, got "
                f"{self.max_lora_rank}", "max_lora_rank")
        require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                "--max-cpu-loras must be at least --max-loras", "max_cpu_loras")
        require(self.enable_lora or not self.lora_modules,
                "--lora-modules needs --enable-lora", "lora_modules")
        try:
            parse_lora_modules(self.lora_modules)
        except InvalidRequestError as exc:
            raise ConfigError(f"{type(self).__name__}.lora_modules: {exc.message}",
                              param="lora_modules") from None

    def _validate_speculation(self) -> None:
        if self.speculative_config is None:
            return
        try:
            self.speculative  # noqa: B018 (parsed to validate)
        except ConfigError as exc:
            raise ConfigError(f"{type(self).__name__}.speculative_config: {exc.message}",
                              param="speculative_config") from None
        # At tensor parallelism rank 0 holds the whole draft: the target's own weights as
        # draft would put the whole target there. With LoRA they would run the target's
        # adapter hooks with the target step's row grouping (another draft has no hooks:
        # it drafts as its base model, and the verify pass applies each row's adapter).
        self.require(not (self.draft_is_target and self.tensor_parallel_size > 1),
                     "a draft model that is the target model itself does not work with "
                     "--tensor-parallel-size above 1 (rank 0 would hold the whole target); "
                     "name a smaller draft model", "speculative_config")
        self.require(not (self.draft_is_target and self.enable_lora),
                     "a draft model that is the target model itself does not work with "
                     "--enable-lora (another draft model, or n-gram speculation, does)",
                     "speculative_config")

    # ----- derived values ---------------------------------------------------------
    @property
    def kernel_knobs(self) -> KernelKnobs:
        """The kernels' process-wide settings these options ask for."""
        return KernelKnobs(pdl=self.pdl, fp8_widen=self.fp8_widen)

    @property
    def draft_is_target(self) -> bool:
        """Whether the speculative config's draft model is the target model's own folder."""
        spec = self.speculative
        return (spec is not None and spec.model is not None
                and os.path.realpath(spec.model) == os.path.realpath(self.model or ""))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config (None: no speculation)."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)

    def seqs_limit(self, gpu_memory_bytes: int = 0, gpu_name: str = "") -> int:
        """The cap on running sequences. Unset, it is 1024 on a GPU of 70 GiB or more other
        than an A100 (H100, H200: room for that many sequences' KV, and decode batches that
        large keep the GPU busy) and 256 elsewhere, as vLLM's defaults are."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        if gpu_memory_bytes >= 70 * GiB and "a100" not in gpu_name.lower():
            return 1024
        return 256

    def prefill_chunk_cap(self, on_gpu: bool = False) -> int:
        """Most prompt tokens one request prefills in a step shared with decodes (0: none).

        Unset: GPU_PREFILL_CHUNK_CAP on a GPU and CPU_PREFILL_CHUNK_CAP on a CPU. Measured
        on an H100 with the 8B shape (loadtest/reports/README.md), a 16k-token prompt beside
        64 decodes took the decodes' p99 ITL from 370-400 ms uncapped to 116 ms at 2048 for
        5% more TTFT of the long prompt; on a 2-core CPU a 2048-token step holds every
        decode back for seconds.
        """
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return GPU_PREFILL_CHUNK_CAP if on_gpu else CPU_PREFILL_CHUNK_CAP

    def batched_tokens(self, max_model_len: int, on_gpu: bool = False) -> int:
        """The per-step token budget. Without chunked prefill a whole prompt must fit one step.

        Unset, it is 8192 on a GPU (big prefill chunks keep the tensor cores busy) and 2048
        on a CPU (smaller steps keep decode latency down), as vLLM's defaults do.
        """
        if self.max_num_batched_tokens is not None:
            self.require(self.enable_chunked_prefill or self.max_num_batched_tokens >= max_model_len,
                         f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at "
                         f"least the context length ({max_model_len}) when chunked prefill is off",
                         "max_num_batched_tokens")
            return self.max_num_batched_tokens
        default = 8192 if on_gpu else 2048
        return default if self.enable_chunked_prefill else max(default, max_model_len)

    def engine_flags(self, *, only_changed: bool = True) -> list[str]:
        """The engine fields as command-line flags (those differing from the defaults):
        how `meshserve up` hands the same engine settings to its worker processes."""
        flags: list[str] = []
        for f in dataclasses.fields(EngineConfig):
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
    """vLLM's short spellings that the worker's command line also takes (-tp N, -tp=N, -ep)."""
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag == "-tp":
            out += ["--tensor-parallel-size", *([value] if eq else [])]
        elif arg == "-ep":
            out.append("--enable-expert-parallel")
        else:
            out.append(arg)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerConfig(RunnerOptions, EngineConfig, ServiceConfig):
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
    role: Literal["mixed", "prefill", "decode"] = option(
        "mixed", "disaggregated serving: prefill (compute prompts and first tokens, hand their "
        "KV to a decode worker), decode (continue them), or mixed (both)")
    kv_handoff: Literal["store", "tcp", "ipc"] = option(
        "store", "how prefilled prompts' KV reaches the decode worker: through the kvstore "
        "(store); pulled straight from the prefill worker over TCP (tcp); or held by the "
        "prefill worker in memory decode workers on its host map and copy from device to "
        "device, GPU to GPU (CUDA IPC), others still pulling it over TCP; the request's "
        "decode worker takes it pushed into a pool of its own, layer by layer while the "
        "prefill computes (ipc)")
    kv_handoff_streams: int = option(4, "parallel TCP connections a decode worker pulls one "
                                        "handoff's blocks over (--kv-handoff tcp)")
    kv_handoff_port: int = option(0, "TCP port a prefill worker serves its handed-off blocks "
                                     "on (--kv-handoff tcp; 0: any free port)")
    kv_handoff_hold_s: float = option(30.0, "seconds a prefill worker holds handed-off blocks "
                                            "that no decode worker pulled (--kv-handoff tcp)")
    kv_handoff_hold_bytes: int = option(
        4 << 30, "most bytes of handed-off blocks a prefill worker holds, the oldest going "
                 "first: room for the prompts being prefilled and those not yet pulled (the "
                 "Llama-3.1-8B shape: 128 KiB a token); --kv-handoff tcp: host memory, taken "
                 "as needed; ipc: the pool taken from the device at start, on a decode "
                 "worker too (the prompts pushed to it and not yet loaded)")
    kv_handoff_push: bool = option(
        False, "--kv-handoff ipc: a decode worker takes prompts' KV pushed into its pool by "
               "the prefill worker layer by layer as computed (off: it takes no pool and "
               "copies the KV from the prefill worker's after the first token; off by "
               "default: slower on the GPU sweep so far, loadtest/reports/disagg/README.md)")
    kv_handoff_send_timeout_s: float = option(
        10.0, "longest a prefill worker waits for a prompt's KV blocks to be ready to hand "
              "off (saved to the kvstore, held or pushed); past it the request moves on and "
              "the decode worker computes what is missing")
    kv_handoff_watermark: float = option(
        0.01, "fraction of its KV cache a decode worker keeps free: a handed-off request "
              "whose prompt blocks would leave less is refused and placed elsewhere")
    idle_trim_interval_s: float = option(
        10.0, "an engine idle for a second hands malloc's free memory back to the system "
              "(malloc_trim), at most once this often, in seconds (0: never)")

    def validate(self) -> None:
        super().validate()
        self.require(self.heartbeat_interval_s is None or self.heartbeat_interval_s > 0,
                     f"must be positive, got {self.heartbeat_interval_s}", "heartbeat_interval_s")
        self.require(self.idle_trim_interval_s >= 0,
                     f"must be >= 0, got {self.idle_trim_interval_s}", "idle_trim_interval_s")
        self.require(self.worker_id is None or bool(self.worker_id.strip()),
                     "must not be blank", "worker_id")
        self.require(self.kv_offload_backlog_bytes > 0,
                     f"must be positive, got {self.kv_offload_backlog_bytes}",
                     "kv_offload_backlog_bytes")
        self.require(not (self.pooling and self.tensor_parallel_size > 1),
                     "a pooling worker runs on one device", "tensor_parallel_size")
        self.require(self.role == "mixed" or self.kv_handoff != "store"
                     or bool(self.kvstore_address and self.kv_offload),
                     "a prefill or decode worker hands KV over through the kvstore: it needs "
                     "--kvstore-address (and --kv-offload), or --kv-handoff tcp or ipc", "role")
        self.require(not (self.kvstore_address and self.kv_offload or self.kv_handoff != "store")
                     or self.enable_prefix_caching,
                     "the KV tier finds blocks by hash: it needs prefix caching",
                     "kv_offload")
        self._validate_handoff()

    def _validate_handoff(self) -> None:
        self.require(self.kv_handoff_streams >= 1,
                     f"must be at least 1, got {self.kv_handoff_streams}", "kv_handoff_streams")
        self.require(0 <= self.kv_handoff_port <= 65535,
                     f"must be in [0, 65535], got {self.kv_handoff_port}", "kv_handoff_port")
        self.require(self.kv_handoff_hold_s > 0,
                     f"must be positive, got {self.kv_handoff_hold_s}", "kv_handoff_hold_s")
        self.require(self.kv_handoff_hold_bytes > 0,
                     f"must be positive, got {self.kv_handoff_hold_bytes}",
                     "kv_handoff_hold_bytes")
        self.require(self.kv_handoff_send_timeout_s > 0,
                     f"must be positive, got {self.kv_handoff_send_timeout_s}",
                     "kv_handoff_send_timeout_s")
        self.require(0 <= self.kv_handoff_watermark <= 1,
                     f"must be in [0, 1], got {self.kv_handoff_watermark}",
                     "kv_handoff_watermark")
        self.require(self.kv_handoff == "store" or self.tensor_parallel_size == 1,
                     "the direct handoff works on one device (as the KV tier)", "kv_handoff")

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
