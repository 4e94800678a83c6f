"""The model of a pooling worker: flat token batches in, pooled vectors out.

    embedder = Embedder(engine_config, pooler_override)   # loads the model (blocking)
    pooled = embedder.embed([[1, 2, 3], [4, 5]])          # [2, H] float32, not yet finished

A batch of inputs runs as ONE forward over their tokens laid end to end, with the same
attention path as the generating engine (`paged_attention` over per-layer KV caches):
every input is a fresh prompt of its own, so its keys and values go to a scratch cache
sized for one batch and are overwritten by the next. No prefix cache, no CUDA graphs:
each input's forward happens once. The token budget of a batch is the engine's
(`--max-num-batched-tokens`), raised to the context length so any input fits one forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from meshserve.kernels.attention import AttentionMetadata
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.device import resolve_device
from meshserve.services.worker.loader import (
    ModelSource,
    load_model,
    load_model_config,
    load_quant_config,
    resolve_dtype,
    resolve_model,
)
from meshserve.services.worker.models.classifier import (
    SequenceClassifier,
    class_labels,
    decoder_config,
    sequence_classifier,
)
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.embedding import DecoderEmbedder
from meshserve.services.worker.models.llama import KVCache
from meshserve.services.worker.models.pooling_config import PoolerConfig, resolve_pooler_config
from meshserve.services.worker.pooling.pooler import pool
from meshserve.shared.errors import ContextLengthError, InvalidRequestError
from meshserve.shared.model_config import ModelFiles, read_model_files

log = logging.getLogger(__name__)


class Embedder:
    """A decoder run as an embedder, with the scratch KV cache of one batch."""

    def __init__(self, config: EngineConfig, pooler_override: str | None = None) -> None:
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.source: ModelSource = resolve_model(config.model, config.load_format)
        files = read_model_files(self.source)
        self.class_labels = class_labels(files.config)
        """A sequence classifier's labels (its vectors are class logits); () otherwise."""
        self.model_config: ModelConfig = ModelConfig.from_hf(
            decoder_config(files.config), generation_config=files.generation,
            source=files.where) if self.class_labels else load_model_config(self.source)
        self.max_model_len = min(self.model_config.max_model_len,
                                 config.max_model_len or self.model_config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.pooler: PoolerConfig = self._pooler(files, pooler_override)
        started = time.monotonic()
        # FP8 weights as for generation; the scratch KV cache stays in the model's dtype.
        model_class = sequence_classifier(len(self.class_labels)) if self.class_labels \
            else DecoderEmbedder
        self.model = load_model(self.source, self.model_config, self.dtype, self.device,
                                config.load_format, model_class=model_class,
                                quant=load_quant_config(self.source, config.quantization))
        self.head = self.model if isinstance(self.model, SequenceClassifier) else None
        log.info("loaded %s as an embedder (%s, pooling %s%s from %s) in %.1fs",
                 self.source.name, self.dtype, self.pooler.pooling_type,
                 ", normalised" if self.pooler.normalize else "", self.pooler.source,
                 time.monotonic() - started)
        on_gpu = self.device.type == "cuda"
        self.max_batch_tokens = max(config.batched_tokens(self.max_model_len, on_gpu),
                                    self.max_model_len)
        self.max_batch_inputs = config.seqs_limit()
        self.block_size = config.block_size
        # A batch of B inputs wastes at most B - 1 partial blocks: room for the budget's
        # tokens plus one block per input.
        blocks = -(-self.max_batch_tokens // self.block_size) + self.max_batch_inputs
        shape = (blocks, self.block_size, self.model_config.cache_kv_heads,
                 self.model_config.cache_head_dim)
        # Per layer: (k_cache, v_cache), each [blocks, block_size, Hkv, D].
        self.kv_caches: list[KVCache] = [
            (torch.empty(shape, dtype=self.dtype, device=self.device),
             torch.empty(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.model_config.num_hidden_layers)]

    def _pooler(self, files: ModelFiles, override: str | None) -> PoolerConfig:
        """A classifier's: its last token's logits, as they are; an embedder's: from
        --pooler-config and the model folder (models/pooling_config.py)."""
        if self.class_labels:
            return PoolerConfig(pooling_type="LAST", normalize=False,
                                hidden_size=len(self.class_labels),
                                source="sequence classification head")
        return resolve_pooler_config(files.config, self.model_config.hidden_size,
                                     self.source.path if self.source.format == "hf" else None,
                                     override)

    @property
    def hidden_size(self) -> int:
        """The length of the pooled vectors: the hidden size, or a classifier's labels."""
        return len(self.class_labels) or self.model_config.hidden_size

    def check_input(self, token_ids: Sequence[int], index: int) -> None:
        """InvalidRequestError for an input the model cannot embed (param `input`)."""
        if not token_ids:
            raise InvalidRequestError(f"input {index} is empty (it has no tokens)",
                                      param="input")
        if len(token_ids) > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {len(token_ids)} tokens in the input for embedding "
                "generation. Please reduce the length of the input.", param="input")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"input {index} holds token id {bad}, outside the "
                                      f"model's vocabulary [0, {vocab})", param="input")

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B, H] float32 pooled (not truncated, not normalised) vectors of `inputs` (a
        classifier's [B, labels] logits), in one forward; the inputs must fit one batch
        (`max_batch_tokens`, `max_batch_inputs`)."""
        lens = [len(ids) for ids in inputs]
        assert 0 < len(inputs) <= self.max_batch_inputs, (
            f"{len(inputs)} inputs, at most {self.max_batch_inputs} per batch")
        assert sum(lens) <= self.max_batch_tokens, (
            f"{sum(lens)} tokens, at most {self.max_batch_tokens} per batch")
        ids = torch.tensor([t for seq in inputs for t in seq], dtype=torch.long)  # [T]
        positions = torch.cat([torch.arange(n) for n in lens])  # [T]
        meta = self._metadata(lens)
        hidden = self.model(ids.to(self.device), positions.to(self.device), self.kv_caches,
                            meta)  # [T, H]
        pooled = pool(hidden, lens, self.pooler.pooling_type)  # [B, H]
        return pooled if self.head is None else self.head.classify(pooled)  # [B, labels]

    def _metadata(self, lens: list[int]) -> AttentionMetadata:
        """Attention metadata of fresh prompts, each in blocks of its own from block 0 on."""
        bs = self.block_size
        tables: list[list[int]] = []
        slots: list[int] = []
        next_block = 0
        for n in lens:
            count = -(-n // bs)
            table = list(range(next_block, next_block + count))
            next_block += count
            tables.append(table)
            slots.extend(table[p // bs] * bs + p % bs for p in range(n))
        width = max(len(t) for t in tables)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device)

        return AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(lens, torch.int32),
            block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            max_query_len=max(lens), max_seq_len=max(lens),
            query_lens_cpu=list(lens), seq_lens_cpu=list(lens))
