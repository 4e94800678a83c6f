"""The engine's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshserve.shared.errors import ConfigError, InvalidRequestError
from meshserve.shared.lora_config import parse_lora_modules
from meshserve.shared.speculative_config import SpeculativeConfig, parse_speculative_config

GiB = 1 << 30


CPU_PREFILL_CHUNK_CAP = 256
GPU_PREFILL_CHUNK_CAP = 2048


@dataclass(frozen=True)
class EngineConfig:
    """How one model replica runs. `None` fields are derived from the model or the device."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    load_format: str = "auto"  # auto | hf | gguf | dummy
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    max_model_len: int | None = None  # cap below the model's context length
    block_size: int = 16
    kv_cache_memory: int = 4 * GiB  # bytes for the KV cache on CPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory this worker may use
    num_kv_blocks: int | None = None  # fixed block count (tests, benchmarks); overrides sizing
    max_num_batched_tokens: int | None = None  # per-step token budget
    max_num_seqs: int | None = None  # sequences running at once (None: by device, see seqs_limit)
    enable_chunked_prefill: bool = True
    # Prompt tokens per request per step while others decode (None: by device, 0: no cap).
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enforce_eager: bool = False
    # Overlapped loop: queue step N+1 before reading step N's tokens (auto: on a GPU).
    async_scheduling: str = "auto"  # auto | on | off
    # What compiles structured-output grammars (none: such requests are refused).
    structured_outputs_backend: str = "xgrammar"  # xgrammar | none
    # Devices (ranks) one model replica is split over (services/worker/parallel/).
    tensor_parallel_size: int = 1
    # Small sums over GPU ranks by NCCL instead of the one-shot all-reduce.
    disable_custom_all_reduce: bool = False
    quantization: str | None = None  # fp8: FP8 decoder weights (docs/quantization.md)
    # With FP8 weights: the LM head in FP8 too (vLLM keeps it in the model's dtype).
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2
    # Multi-LoRA serving (vLLM's --enable-lora and friends; docs/lora.md).
    enable_lora: bool = False
    max_loras: int = 1  # adapters in device memory at once (and in one step)
    max_lora_rank: int = 16  # largest adapter rank accepted; device slots are this wide
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)
    # Adapters served from the start: comma-separated name=path, or vLLM's JSON objects.
    lora_modules: str | None = None
    # vLLM's --speculative-config JSON (shared/speculative_config.py); None: no speculation.
    speculative_config: str | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        check(self.load_format in ("auto", "hf", "gguf", "dummy"),
              f"--load-format must be auto, hf, gguf or dummy, got {self.load_format!r}",
              "load_format")
        check(self.dtype in ("auto", "bfloat16", "float16", "float32"),
              f"--dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}", "dtype")
        check(self.block_size in (8, 16, 32, 64, 128),
              f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}",
              "block_size")
        check(self.kv_cache_memory > 0, "--kv-cache-memory must be positive", "kv_cache_memory")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              "--gpu-memory-utilization must be in (0, 1]", "gpu_memory_utilization")
        check(self.num_kv_blocks is None or self.num_kv_blocks > 0,
              "--num-kv-blocks must be positive", "num_kv_blocks")
        check(self.max_num_seqs is None or self.max_num_seqs > 0,
              "--max-num-seqs must be positive", "max_num_seqs")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens > 0,
              "--max-num-batched-tokens must be positive", "max_num_batched_tokens")
        check(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
              "--long-prefill-token-threshold must be >= 0", "long_prefill_token_threshold")
        check(self.max_model_len is None or self.max_model_len > 1,
              "--max-model-len must be at least 2", "max_model_len")
        check(self.async_scheduling in ("auto", "on", "off"),
              f"--async-scheduling must be auto, on or off, got {self.async_scheduling!r}",
              "async_scheduling")
        check(self.structured_outputs_backend in ("xgrammar", "none"),
              "--structured-outputs-backend must be xgrammar or none, got "
              f"{self.structured_outputs_backend!r}", "structured_outputs_backend")
        check(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be at least 1",
              "tensor_parallel_size")
        check(self.quantization in (None, "fp8"),
              f"--quantization must be fp8 (or unset), got {self.quantization!r}",
              "quantization")
        check(self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
              f"--kv-cache-dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2, got "
              f"{self.kv_cache_dtype!r}", "kv_cache_dtype")
        check(self.max_loras > 0, "--max-loras must be positive", "max_loras")
        check(self.max_lora_rank in (1, 8, 16, 32, 64, 128, 256, 320, 512),
              "--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512, got "
              f"{self.max_lora_rank}", "max_lora_rank")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
              "--max-cpu-loras must be at least --max-loras", "max_cpu_loras")
        check(self.enable_lora or not self.lora_modules,
              "--lora-modules needs --enable-lora", "lora_modules")
        parse_lora_modules(self.lora_modules)  # InvalidRequestError naming lora_modules
        if self.speculative_config is not None:
            try:
                self.speculative  # noqa: B018 (parsed to validate)
            except ConfigError as exc:
                raise InvalidRequestError(exc.message, param="speculative_config") from None
        # At tensor parallelism rank 0 holds the whole draft: the target's own weights as
        # draft would put the whole target there. With LoRA they would run the target's
        # adapter hooks with the target step's row grouping (another draft has no hooks:
        # it drafts as its base model, and the verify pass applies each row's adapter).
        check(not (self.draft_is_target and self.tensor_parallel_size > 1),
              "a draft model that is the target model itself does not work with "
              "--tensor-parallel-size above 1 (rank 0 would hold the whole target); name a "
              "smaller draft model", "speculative_config")
        check(not (self.draft_is_target and self.enable_lora),
              "a draft model that is the target model itself does not work with "
              "--enable-lora (another draft model, or n-gram speculation, does)",
              "speculative_config")
        check(self.scheduling_policy in ("fcfs", "priority"),
              f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}",
              "scheduling_policy")

    @property
    def draft_is_target(self) -> bool:
        """Whether the speculative config's draft model is the target model's own folder."""
        spec = self.speculative if self.speculative_config is not None else None
        return (spec is not None and spec.model is not None
                and os.path.realpath(spec.model) == os.path.realpath(self.model))

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
        by loadtest/hol_prefill.py (loadtest/reports/README.md): on an H100 with the 8B
        shape, a 16k-token prompt beside 64 decodes took the decodes' p99 ITL from 370-400 ms
        uncapped to 116 ms at 2048 for 5% more TTFT of the long prompt; on a 2-core CPU a
        2048-token step holds every decode back for seconds.
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
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise InvalidRequestError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                    f"the context length ({max_model_len}) when chunked prefill is off",
                    param="max_num_batched_tokens")
            return self.max_num_batched_tokens
        default = 8192 if on_gpu else 2048
        return default if self.enable_chunked_prefill else max(default, max_model_len)
