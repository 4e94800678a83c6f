"""How many KV-cache blocks a worker gets, and how large its piecewise CUDA graphs are.

On a GPU the cache takes what is left of this worker's share of the device
(--gpu-memory-utilization, as vLLM counts it) once the loaded weights, the activations of
the largest step and the CUDA graphs' pools are accounted for; on a CPU it takes
--kv-cache-memory bytes.
"""

from __future__ import annotations

import logging

import torch

from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.model_runner import (
    kv_cache_bytes_per_block,
    profile_activation_bytes,
)
from meshserve.services.worker.models.llama import CausalLM
from meshserve.shared.errors import ModelLoadError

log = logging.getLogger(__name__)

# What the CUDA context and libraries (cuBLAS workspaces) of this process take beside
# PyTorch's pool, counted against this worker's share of the device.
_CUDA_CONTEXT_BYTES = 768 << 20
# Device memory always left free when sizing the cache next to other processes.
_FREE_MARGIN = 256 << 20
# Memory kept free for the decode CUDA graphs' pool (their activations are small).
_GRAPH_MEMORY_RESERVE = 512 << 20
# Steps of up to this many tokens replay piecewise CUDA graphs; larger ones are long
# enough on the device for eager launches to keep up.
PIECEWISE_MAX_TOKENS = 2048


def piecewise_tokens(batched_tokens: int) -> int:
    """The largest step the piecewise CUDA graphs are captured for."""
    return min(PIECEWISE_MAX_TOKENS, batched_tokens)


def gpu_memory_and_name(device: torch.device) -> tuple[int, str]:
    """(total bytes, name) of a CUDA device; (0, "") for a CPU."""
    if device.type != "cuda":
        return 0, ""
    props = torch.cuda.get_device_properties(device)
    return props.total_memory, props.name


def kv_blocks_that_fit(model: CausalLM, config: EngineConfig, kv_dtype: torch.dtype,
                       device: torch.device, max_num_seqs: int, batched_tokens: int,
                       draft_bytes_per_block: int = 0) -> int:
    """KV blocks of `config.block_size` tokens that fit this worker's memory (a draft
    model's cache, `draft_bytes_per_block`, rides along with every block).

    Raises ModelLoadError when not even one block fits."""
    # The model's own config: a tensor-parallel rank holds only its share of KV heads.
    per_block = kv_cache_bytes_per_block(model.config, config.block_size, kv_dtype)
    per_block += draft_bytes_per_block
    if device.type == "cuda":
        # What is left of this worker's share once weights (already loaded), the peak
        # activations of the largest step and the decode graphs are accounted for.
        activations = profile_activation_bytes(
            model, model.config, batched_tokens, min(max_num_seqs, batched_tokens),
            config.block_size, kv_dtype, device)
        free, total = torch.cuda.mem_get_info(device)
        graphs = 0
        if not config.enforce_eager:
            # The piecewise graphs' pool holds the temporaries of their largest step.
            pieces = piecewise_tokens(batched_tokens)
            graphs = _GRAPH_MEMORY_RESERVE + activations * pieces // batched_tokens
        # --gpu-memory-utilization is this worker's share of the device, as in vLLM: its
        # own memory (weights, PyTorch's pool, the CUDA context) counts against it, other
        # processes' memory does not (two workers at 0.45 share one GPU), but the cache
        # never takes more than is free now.
        own = torch.cuda.memory_reserved(device) + _CUDA_CONTEXT_BYTES
        share = int(total * config.gpu_memory_utilization) - own
        budget = min(share, free - _FREE_MARGIN) - activations - graphs
        log.info("GPU memory: %.1f GiB total, %.1f GiB in use (%.1f GiB by this worker), "
                 "%.2f GiB activations, %.2f GiB KV cache", total / 2**30,
                 (total - free) / 2**30, own / 2**30, activations / 2**30,
                 max(budget, 0) / 2**30)
    else:
        budget = config.kv_cache_memory
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ModelLoadError(
            f"no memory left for the KV cache: one block needs {per_block} bytes and the "
            f"budget is {budget} bytes (raise --kv-cache-memory or --gpu-memory-utilization)")
    return int(num_blocks)
